"""Hugging Face checkpoints in and out, against transformers' own logits.

The fixtures (tests/fixtures/hf/, made by make_fixtures.py with torch + transformers) are tiny
random Qwen3, Qwen2 (q/k/v biases, tied head), Llama (Llama-3 RoPE scaling, one kv head) and SDAR
(Qwen3 weights, SDAR's config keys, a padded vocabulary) checkpoints with transformers' logits
under the causal mask and under the block-diffusion mask passed as an explicit 4-D mask.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from bd_core import ViewLayout
from bd_models import (
    BlockDiffusionLM,
    ModelConfig,
    PretrainedError,
    from_pretrained,
    make_mesh,
    read_hf_config,
    save_pretrained,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ARCHS = ("qwen3", "qwen2", "llama", "sdar")


def _layout(ids: np.ndarray, block_size: int | None) -> ViewLayout:
    """One clean view; block ids = position // block_size, or one block per position (causal)."""
    b, t = ids.shape
    pos = np.broadcast_to(np.arange(t), (b, t))
    blocks = pos if block_size is None else pos // block_size
    return ViewLayout(tokens=jnp.asarray(ids), positions=jnp.asarray(pos), block_ids=jnp.asarray(blocks),
                      view_ids=jnp.zeros((b, t), jnp.int32), valid=jnp.ones((b, t), bool))


def _reference(arch: str):
    ref = np.load(FIXTURES / arch / "reference.npz")
    return ref["input_ids"], int(ref["block_size"]), ref["logits_causal"], ref["logits_block"]


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(model)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["dense", "blocked"])
def test_logits_equal_transformers(arch, attention):
    ids, block, causal, blockwise = _reference(arch)
    model = from_pretrained(FIXTURES / arch, block_size=block, attention=attention, q_tile=4, k_tile=4)
    np.testing.assert_allclose(np.asarray(model(_layout(ids, block))), blockwise, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(model(_layout(ids, None))), causal, atol=1e-4, rtol=0)
    assert np.abs(blockwise - causal).max() > 1.0  # the two layouts are really different


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_transformers_4x_config_form_reads_the_same(arch, tmp_path):
    """Released checkpoints carry the 4.x form (top-level rope_theta / rope_scaling)."""
    folder = tmp_path / arch
    shutil.copytree(FIXTURES / arch, folder)
    shutil.copy(folder / "config.v4.json", folder / "config.json")
    assert "rope_parameters" not in read_hf_config(folder)
    v4 = from_pretrained(folder, block_size=4)
    v5 = from_pretrained(FIXTURES / arch, block_size=4)
    assert v4.config == v5.config
    ids, block, _, blockwise = _reference(arch)
    np.testing.assert_allclose(np.asarray(v4(_layout(ids, block))), blockwise, atol=1e-4, rtol=0)


def test_architecture_options_follow_the_checkpoint():
    configs = {arch: from_pretrained(FIXTURES / arch, block_size=4).config for arch in ARCHS}
    assert configs["qwen3"].qk_norm and not configs["qwen3"].qkv_bias and configs["qwen3"].head_dim == 16
    assert configs["qwen2"].qkv_bias and configs["qwen2"].tie_embeddings and configs["qwen2"].norm_eps == 1e-5
    assert configs["llama"].rope_scaling is not None and configs["llama"].n_kv_heads == 1
    assert configs["sdar"].block_size == 4 and configs["sdar"].vocab_size == 320
    default = BlockDiffusionLM(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
                                           d_ff=16, block_size=2), key=jax.random.key(0))
    assert all(getattr(default.layers, f) is None for f in ("q_norm", "k_norm", "bq", "bk", "bv"))


@pytest.mark.parametrize("arch", ["qwen3", "sdar"])
def test_a_config_without_head_dim_gets_its_familys_default_of_128(arch):
    """transformers' Qwen3Config and SDAR's SDARConfig default head_dim to 128, not hidden_size /
    heads as Qwen2 and Llama do."""
    from bd_models import model_config_from_hf, read_hf_config

    raw = {k: v for k, v in read_hf_config(FIXTURES / arch).items() if k != "head_dim"}
    assert model_config_from_hf(raw, block_size=4).head_dim == 128


def test_sdar_block_size_comes_from_its_config_and_autoregressive_needs_one():
    assert from_pretrained(FIXTURES / "sdar").config.block_size == 4
    with pytest.raises(PretrainedError, match="no block size.*pass block_size="):
        from_pretrained(FIXTURES / "qwen3")


@pytest.mark.parametrize("arch", ARCHS)
def test_import_export_import_is_bit_exact(arch, tmp_path):
    model = from_pretrained(FIXTURES / arch, block_size=4)
    out = save_pretrained(model, tmp_path / "out", base_config=read_hf_config(FIXTURES / arch), max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    again = from_pretrained(out, block_size=4)
    assert again.config == model.config
    for a, b in zip(_leaves(model), _leaves(again), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # The exported tensors are the imported files' tensors, byte for byte, under the same names.
    source = {}
    for file in (FIXTURES / arch).glob("*.safetensors"):
        with safe_open(str(file), "numpy") as f:
            source.update({k: f.get_tensor(k) for k in f.keys()})
    exported = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "numpy") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
    assert exported.keys() == source.keys()
    for name, value in source.items():
        assert np.array_equal(exported[name], value), name
    written = read_hf_config(out)
    assert written["model_type"] == read_hf_config(FIXTURES / arch)["model_type"]


def test_a_fast_dllm_export_says_one_block_size(tmp_path):
    """Fast-dLLM v2's config keeps its block size as `bd_size`, which its own code reads: read at
    another block size, the export wrote `block_size` and left the old `bd_size` beside it."""
    folder = _copy(tmp_path, "qwen2")
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "bd_size": 8}))
    assert from_pretrained(folder).config.block_size == 8
    out = save_pretrained(from_pretrained(folder, block_size=4), tmp_path / "out", base_config=read_hf_config(folder))
    written = read_hf_config(out)
    assert written["block_size"] == written["bd_size"] == 4
    assert "bd_size" not in read_hf_config(save_pretrained(from_pretrained(FIXTURES / "sdar"), tmp_path / "sdar",
                                                           base_config=read_hf_config(FIXTURES / "sdar")))


def test_an_export_that_fails_part_way_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """An export over an earlier one deleted the earlier weights first: a full disk at the second
    shard left config.json and a temp file, no weights. It is now written beside the folder and
    swapped in; files of the folder that an export does not write are kept."""
    import safetensors.numpy

    model = from_pretrained(FIXTURES / "qwen3", block_size=4)
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    (out / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = safetensors.numpy.save_file, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(model, out, max_shard_bytes=40_000, dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    save_pretrained(model, out, dtype="bfloat16")  # one file now: the old shards and index are gone
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert read_hf_config(out)["torch_dtype"] == "bfloat16" and from_pretrained(out, block_size=4).config.n_layers
    # A destination that is a link to another folder, and the folder the command runs in, are written in place.
    (tmp_path / "disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk", target_is_directory=True)
    for _ in range(2):
        save_pretrained(model, tmp_path / "link", max_shard_bytes=40_000)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "disk" / "model.safetensors.index.json").is_file()
    monkeypatch.chdir(tmp_path / "disk")
    save_pretrained(model, ".")
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["config.json", "model.safetensors"]


def test_float32_master_weights_export_in_the_dtype_asked(tmp_path):
    """A bfloat16 release read with float32 master weights (the default) exports at its own size
    with dtype="bfloat16": the same tensors, bit for bit, as a bfloat16 import exports."""
    bf16 = save_pretrained(from_pretrained(FIXTURES / "qwen3", block_size=4, param_dtype="bfloat16"), tmp_path / "a")
    cast = save_pretrained(from_pretrained(FIXTURES / "qwen3", block_size=4), tmp_path / "b", dtype="bfloat16")
    assert read_hf_config(cast)["torch_dtype"] == "bfloat16"
    for a, b in zip(_leaves(from_pretrained(bf16, param_dtype="bfloat16")),
                    _leaves(from_pretrained(cast, param_dtype="bfloat16")), strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    with pytest.raises(PretrainedError, match=r"dtype 'int8' is not one of \['float32', 'bfloat16', 'float16'\]"):
        save_pretrained(from_pretrained(FIXTURES / "qwen3", block_size=4), tmp_path / "c", dtype="int8")


def test_bfloat16_import_and_export_round_trip(tmp_path):
    model = from_pretrained(FIXTURES / "qwen3", block_size=4, param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(model)} == {jnp.dtype("bfloat16")}
    out = save_pretrained(model, tmp_path / "bf16")
    assert read_hf_config(out)["torch_dtype"] == "bfloat16"
    again = from_pretrained(out, param_dtype="bfloat16")
    for a, b in zip(_leaves(model), _leaves(again), strict=True):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_import_on_the_mesh_equals_single_device():
    ids, block, _, _ = _reference("qwen3")
    mesh = make_mesh(1, 4, 2)  # fsdp x model
    sharded = from_pretrained(FIXTURES / "qwen3", block_size=block, mesh=mesh, attention="dense")
    single = from_pretrained(FIXTURES / "qwen3", block_size=block, attention="dense")
    wq = sharded.layers.wq
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "model")
    assert wq.addressable_shards[0].data.shape == (2, 32 // 4, 64 // 2)
    for a, b in zip(_leaves(sharded), _leaves(single), strict=True):
        assert np.array_equal(a, b)
    with jax.set_mesh(mesh):
        logits = np.asarray(jax.jit(lambda m, lay: m(lay))(sharded, _layout(ids, block)))
    np.testing.assert_allclose(logits, np.asarray(single(_layout(ids, block))), atol=1e-5, rtol=0)


def test_vocabulary_grows_with_mean_rows():
    """An added mask token: new embedding and untied-head rows are the mean of the file's rows,
    and the logits of the existing tokens over the existing vocabulary are unchanged."""
    base = from_pretrained(FIXTURES / "llama", block_size=4)
    grown = from_pretrained(FIXTURES / "llama", block_size=4, vocab_size=base.config.vocab_size + 1)
    assert base.lm_head is not None and grown.lm_head is not None
    np.testing.assert_allclose(grown.embedding[-1], base.embedding.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(grown.lm_head[:, -1], base.lm_head.mean(axis=1), atol=1e-6)
    ids, block, _, _ = _reference("llama")
    layout = _layout(ids, block)
    np.testing.assert_array_equal(np.asarray(grown(layout))[..., :-1], np.asarray(base(layout)))
    with pytest.raises(PretrainedError, match="smaller than the checkpoint"):
        from_pretrained(FIXTURES / "llama", block_size=4, vocab_size=10)


def test_an_added_token_inside_padded_rows_gets_the_mean_row():
    """SDAR's file has 320 rows for 288 tokens: a token added at id 288 reuses a padded row, set
    to the mean of the 288 real ones."""
    base = from_pretrained(FIXTURES / "sdar")
    added = from_pretrained(FIXTURES / "sdar", new_rows_from=288)
    assert added.config == base.config and base.lm_head is not None and added.lm_head is not None
    np.testing.assert_allclose(added.embedding[288:], np.broadcast_to(base.embedding[:288].mean(0), (32, 32)),
                               atol=1e-6)
    np.testing.assert_allclose(added.lm_head[:, 300], base.lm_head[:, :288].mean(1), atol=1e-6)
    np.testing.assert_array_equal(added.embedding[:288], base.embedding[:288])
    with pytest.raises(PretrainedError, match="new_rows_from=400 must be in 1..320"):
        from_pretrained(FIXTURES / "sdar", new_rows_from=400)


# --- what a new user gets wrong: one message naming the file or tensor and the fix --------------

def _copy(tmp_path: Path, arch: str) -> Path:
    folder = tmp_path / arch
    shutil.copytree(FIXTURES / arch, folder)
    return folder


def test_folder_without_config_json(tmp_path):
    folder = _copy(tmp_path, "qwen2")
    (folder / "config.json").unlink()
    with pytest.raises(PretrainedError, match=r"config.json' is missing"):
        from_pretrained(folder, block_size=4)
    with pytest.raises(PretrainedError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere", block_size=4)
    with pytest.raises(PretrainedError, match=r"model.safetensors' is a file; pass the folder that holds it"):
        from_pretrained(folder / "model.safetensors", block_size=4)
    orbax = tmp_path / "sft-student"  # a bdlm stage's checkpoint: step folders Orbax marks as complete
    (orbax / "6").mkdir(parents=True)
    (orbax / "6" / "_CHECKPOINT_METADATA").write_text("{}")
    for given in (orbax, orbax / "6"):
        with pytest.raises(PretrainedError, match=r"is a bdlm stage checkpoint \(Orbax steps\), not a Hugging Face "
                                                  r"folder: a preset adopts it as \[teacher\] / \[student\]"):
            from_pretrained(given, block_size=4)


def test_unsupported_model_type(tmp_path):
    folder = _copy(tmp_path, "qwen2")
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "mixtral"}))
    with pytest.raises(PretrainedError, match=r"model_type 'mixtral' is not supported.*'llama'"):
        from_pretrained(folder, block_size=4)


def test_truncated_safetensors_file(tmp_path):
    folder = _copy(tmp_path, "qwen2")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedError, match=r"model.safetensors' is not a readable safetensors file.*truncated"):
        from_pretrained(folder, block_size=4)


def test_missing_shard(tmp_path):
    folder = _copy(tmp_path, "qwen3")
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(PretrainedError, match=r"shard .*model-00002-of-00003.safetensors' named in .* is missing"):
        from_pretrained(folder, block_size=4)


def test_weights_that_do_not_match_the_config(tmp_path):
    folder = _copy(tmp_path, "qwen2")
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": 48, "tie_word_embeddings": False}))
    with pytest.raises(PretrainedError) as err:
        from_pretrained(folder, block_size=4)
    message = str(err.value)
    assert "missing ['lm_head.weight']" in message
    assert "model.layers.0.mlp.gate_proj.weight: file [64, 32], config.json implies [48, 32]" in message


def test_refused_architecture_options_are_named(tmp_path):
    folder = _copy(tmp_path, "llama")
    raw = read_hf_config(folder)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps({**raw, "rope_parameters": yarn}))
    with pytest.raises(PretrainedError, match="RoPE type 'yarn' is not supported"):
        from_pretrained(folder, block_size=4)
    (folder / "config.json").write_text(json.dumps({**raw, "mlp_bias": True}))
    with pytest.raises(PretrainedError, match="mlp_bias = True is not supported"):
        from_pretrained(folder, block_size=4)
