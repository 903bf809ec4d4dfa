"""Pipeline runs that start from Hugging Face checkpoints: what is read, what is pinned, and what
is refused at the start (before anything trains), by name; the user's JSONL is checked there too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_core import ConfigError
from bd_models import from_pretrained, read_hf_config
from bd_train.stages import Run, StageError, check_adopted, parse_pipeline_config

FIXTURES = Path(__file__).resolve().parents[2] / "models" / "tests" / "fixtures" / "hf"


def _preset(teacher: Path, student: Path, **tokenizer) -> dict:
    return {"task": {"name": "sort", "params": {"length": 4}},
            "canvas": {"prompt_len": 16, "max_new_tokens": 8, "block_size": 4},
            "teacher": {"pretrained": str(teacher)}, "student": {"pretrained": str(student)},
            "tokenizer": tokenizer}


def test_the_checkpoint_sets_architecture_tokenizer_and_start_weights():
    run = Run(parse_pipeline_config(_preset(FIXTURES / "sdar", FIXTURES / "sdar")))
    tok = run.tokenizer
    assert tok.mask_id == 287 and tok.eos_id == 286 and tok.pad_id == tok.mask_id  # from tokenizer_config.json
    config = run.model_config("student")
    assert config.qk_norm and config.head_dim == 16 and config.vocab_size == 320 and config.block_size == 4
    identity = run.identity("student").fields
    assert identity["tokenizer"] == tok.identity and len(identity["pretrained"]) == 16
    state = run.initial_state("student", config, _optimizer(), key=jax.random.key(0))
    expected = from_pretrained(FIXTURES / "sdar")
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(expected), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _optimizer():
    from bd_train import make_optimizer
    from bd_train._optim import OptimizerConfig

    return make_optimizer(OptimizerConfig(learning_rate=1e-3))


def test_changed_weights_change_the_identity(tmp_path):
    folder = tmp_path / "sdar"
    shutil.copytree(FIXTURES / "sdar", folder)
    before = Run(parse_pipeline_config(_preset(folder, folder))).identity("student")
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1e-5}))
    after = Run(parse_pipeline_config(_preset(folder, folder))).identity("student")
    assert before.fields["pretrained"] != after.fields["pretrained"]
    assert before.fields["architecture"]["norm_eps"] != after.fields["architecture"]["norm_eps"]


def test_teacher_and_student_with_different_tokenizers_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"teacher's .*qwen2/tokenizer.json.* and the student's .*sdar/tokenizer.json"
                                          r".* differ"):
        parse_pipeline_config(_preset(FIXTURES / "qwen2", FIXTURES / "sdar"))


def test_output_vocabularies_must_agree_for_distillation():
    config = parse_pipeline_config(_preset(FIXTURES / "sdar", FIXTURES / "qwen3"))  # one tokenizer, 320 vs 288 rows
    with pytest.raises(StageError, match="teacher vocab_size 320 != student vocab_size 288"):
        check_adopted(config)


def test_a_tokenizer_without_a_mask_token_is_refused_unless_one_is_added():
    config = parse_pipeline_config(_preset(FIXTURES / "llama", FIXTURES / "llama"))
    with pytest.raises(StageError, match=r"llama/tokenizer.json' has no mask_token '<\|mask\|>'.*add_mask_token"):
        check_adopted(config)
    run = Run(parse_pipeline_config(_preset(FIXTURES / "llama", FIXTURES / "llama", add_mask_token=True)))
    check_adopted(run.config)
    assert run.tokenizer.mask_id == 287 and run.model_config("student").vocab_size == 288  # the file has 287 rows
    assert run.identity("student").fields["tokenizer"].endswith("+<|mask|>")


def test_bad_pretrained_folders_fail_on_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"student.pretrained: checkpoint folder .*nowhere.* does not exist"):
        parse_pipeline_config(_preset(FIXTURES / "sdar", tmp_path / "nowhere"))
    folder = tmp_path / "mixtral"
    shutil.copytree(FIXTURES / "qwen2", folder)
    (folder / "config.json").write_text(json.dumps({**read_hf_config(folder), "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match=r"teacher.pretrained: .*model_type 'mixtral' is not supported"):
        parse_pipeline_config(_preset(folder, folder))
    missing = tmp_path / "missing_shard"  # the weights are checked before anything trains: no role's SFT runs first
    shutil.copytree(FIXTURES / "sdar", missing)
    (missing / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(StageError, match=r"^student\.pretrained: shard .*model-00003-of-00004\.safetensors' named in "
                                         r"model\.safetensors\.index\.json is missing"):
        check_adopted(parse_pipeline_config(_preset(FIXTURES / "sdar", missing)))
    cut = tmp_path / "cut"
    shutil.copytree(FIXTURES / "sdar", cut)
    shard = cut / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:2000])
    with pytest.raises(StageError, match=r"^teacher\.pretrained: .*model-00002-of-00004\.safetensors' is not a "
                                         r"readable safetensors file"):
        check_adopted(parse_pipeline_config(_preset(cut, FIXTURES / "sdar")))
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURES / "sdar", broken)
    (broken / "tokenizer_config.json").write_text('{"mask_token": ')
    with pytest.raises(StageError, match=r"broken/tokenizer_config\.json: not valid JSON .*\[tokenizer\] mask_token"):
        check_adopted(parse_pipeline_config(_preset(broken, broken)))


def test_a_hugging_face_folder_is_evaluated_with_a_preset(tmp_path):
    from bd_train.evaluate import evaluate, main

    preset = (Path(__file__).resolve().parents[3] / "flows" / "configs" / "pretrained.toml").read_text()
    first = evaluate(FIXTURES / "sdar", config=preset, samples=2, n=4, thresholds=(0.9,))
    again = evaluate(FIXTURES / "sdar", config=preset, samples=2, n=4, thresholds=(0.9,))
    assert first["n"] == 4 and set(first["pass_at_k"]) == {"pass@1", "pass@2"}
    assert [p["decoding"] for p in first["accuracy_vs_nfe"]] == ["τ 0.9", "one per step"]
    strip = lambda r: [{k: v for k, v in p.items() if k != "tokens_per_second"} for p in r["accuracy_vs_nfe"]]  # noqa: E731
    assert (first["greedy"], first["pass_at_k"], strip(first)) == (again["greedy"], again["pass_at_k"], strip(again))
    assert main(["--checkpoint", str(FIXTURES / "sdar")]) == 2  # a HF folder needs --config, said in one line


def test_a_malformed_jsonl_line_is_refused_at_the_start_naming_file_and_line(tmp_path):
    """It used to fail 16-27 s in, inside the SFT step, as two raw tracebacks."""
    good = tmp_path / "eval.jsonl"
    good.write_text('{"prompt": "3 1 2=", "completion": "1 2 3"}\n')
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "3 1 2=", "completion": "1 2 3"}\n{"prompt": "2 1=", "completion": \n')
    config = parse_pipeline_config({"task": {"train_jsonl": str(bad), "eval_jsonl": str(good)}})
    with pytest.raises(StageError, match=r"train.jsonl:2"):
        check_adopted(config)


def test_data_files_edited_in_place_change_the_training_fingerprint_by_key(tmp_path):
    """The stages' checkpoints pin the data files' bytes: a JSONL edited at the same path (or a
    built-in task's file param) is named on resume like any changed setting."""
    line = '{"prompt": "3 1 2=", "completion": "1 2 3"}\n'
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(line)
    held_out.write_text(line)
    preset = {"task": {"train_jsonl": str(train), "eval_jsonl": str(held_out)}}
    before = Run(parse_pipeline_config(preset)).training("sft-student")
    assert Run(parse_pipeline_config(preset)).training("sft-student") == before
    train.write_text(line.replace("3 1 2", "2 1 3"))
    after = Run(parse_pipeline_config(preset)).training("sft-student")
    assert set(before.diff(after)) == {"data.train_jsonl"}
    math, math_eval = tmp_path / "math.jsonl", tmp_path / "math_eval.jsonl"
    math.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    math_eval.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    math_preset = {"task": {"name": "math", "params": {"path": str(math), "eval_path": str(math_eval)}}}
    before = Run(parse_pipeline_config(math_preset)).training("grpo")
    math.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    assert set(before.diff(Run(parse_pipeline_config(math_preset)).training("grpo"))) == {"data.params.path"}
    sort = Run(parse_pipeline_config({"task": {"name": "sort"}})).training("grpo")
    assert "data" not in sort.fields  # a generated task reads no file: its fingerprint is as before


def test_a_hub_repo_pins_its_commit_and_a_moved_branch_is_refused_by_name(hub_cache, tmp_path):
    """`pretrained = "org/name"` reads the Hub cache's snapshot; the identity records the repo and the
    resolved commit, so a resume after `main` moved to another commit (same weights) is refused
    naming the commit, and `[run] allow_changes` can accept it deliberately."""
    from bd_core import FingerprintMismatch
    from bd_train import Checkpointer
    from bd_train.stages import _sections

    repo = "bdlm-test/tiny-sdar"
    snapshot = hub_cache("sdar", repo, "a" * 40)
    by_id = Run(parse_pipeline_config(_preset(Path(repo), Path(repo))))
    by_folder = Run(parse_pipeline_config(_preset(snapshot, snapshot)))
    identity = by_id.identity("student")
    assert identity.fields["pretrained_source"] == {"repo_id": repo, "revision": "main", "commit": "a" * 40}
    assert identity.fields["pretrained"] == by_folder.identity("student").fields["pretrained"]
    state = by_id.initial_state("student", by_id.model_config("student"), _optimizer(), key=jax.random.key(0))
    with Checkpointer(tmp_path / "ckpt") as checkpoints:
        checkpoints.save(state, fingerprints={"identity": identity})

    hub_cache("sdar", repo, "b" * 40)  # the branch moved to another commit
    _sections._resolve_in.cache_clear()  # a new process, as a resume is
    moved = Run(parse_pipeline_config(_preset(Path(repo), Path(repo)))).identity("student")
    with Checkpointer(tmp_path / "ckpt", create=False) as checkpoints:
        with pytest.raises(FingerprintMismatch, match=r"identity\.pretrained_source\.commit"):
            checkpoints.check_fingerprints({"identity": moved})
        accepted = checkpoints.check_fingerprints({"identity": moved}, allow=["identity.pretrained_source"])
    assert accepted == {"identity.pretrained_source.commit": ("a" * 40, "b" * 40)}


def test_the_canvas_block_defaults_to_the_checkpoints_and_another_is_said(tmp_path, capsys):
    """`[canvas] block_size` left out took the canvas's default (4) over a checkpoint trained at
    8, silently, and exported it as 4. It now defaults to the checkpoint's (SDAR's `block_size`,
    Fast-dLLM v2's `bd_size`); a block size set on purpose is kept and said at the start."""
    folder = tmp_path / "sdar"
    shutil.copytree(FIXTURES / "sdar", folder)
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "block_size": 8}))
    preset = _preset(folder, folder)
    preset["canvas"] = {"prompt_len": 16, "max_new_tokens": 8}
    assert parse_pipeline_config(preset)["canvas"]["block_size"] == 8
    (folder / "config.json").write_text(json.dumps({**{k: v for k, v in raw.items() if k != "block_size"},
                                                    "bd_size": 8}))
    assert parse_pipeline_config(preset)["canvas"]["block_size"] == 8
    preset["canvas"]["max_new_tokens"] = 12
    with pytest.raises(ConfigError, match=r"canvas.block_size = 8 is the student's pretrained checkpoint's; set "
                                          r"\[canvas\] block_size to choose another"):
        parse_pipeline_config(preset)
    explicit = _preset(folder, folder)  # block_size = 4, set
    config = parse_pipeline_config(explicit)
    assert config["canvas"]["block_size"] == 4
    check_adopted(config)
    assert ("canvas.block_size = 4: the student's pretrained checkpoint was trained with block size 8; its model "
            "runs, and exports, at 4") in capsys.readouterr().err
    assert parse_pipeline_config(_preset(FIXTURES / "qwen3", FIXTURES / "qwen3"))["canvas"]["block_size"] == 4


def test_a_revision_without_a_repo_is_refused_by_name():
    with pytest.raises(ConfigError, match="revision: 'v1' is given without pretrained"):
        parse_pipeline_config({"student": {"revision": "v1"}})


def test_sft_from_another_stages_model_with_lora_trains_adapters_on_it_and_reads_back(tmp_path):
    """`run_sft(start=...)` with LoRA in `sft`: adapters on the start model (which stays frozen),
    pinned to that checkpoint, so what it saves restores. It used to train every weight while
    pinning adapters, and the result could not be read back."""
    from bd_models import count_params
    from bd_train import Checkpointer, TrainState

    preset = _preset(FIXTURES / "sdar", FIXTURES / "sdar")
    preset["student"]["lora"] = {"rank": 2, "stages": ["sft"]}
    run = Run(parse_pipeline_config(preset))
    config, identity, optimizer = run.model_config("student"), run.identity("student"), _optimizer()
    start = tmp_path / "opd"
    with Checkpointer(start) as checkpoints:
        checkpoints.save(TrainState.init(run.pretrained_model("student"), optimizer, key=jax.random.key(0)),
                         fingerprints={"identity": identity})
    state = run.initial_state("student", config, optimizer, key=jax.random.key(1), start=("opd", str(start)))
    counts = count_params(state.model)
    assert 0 < counts["trained"] < counts["total"] // 10
    pinned = {"identity": identity, **run.adapters_pin(state.model, run.lora("student", "sft"),
                                                       {"checkpoint": str(start)})}
    with Checkpointer(tmp_path / "sft-student") as checkpoints:
        checkpoints.save(state, fingerprints=pinned)
    restored = run.restore_model(tmp_path / "sft-student", config, identity, what="the SFT result")
    assert restored.config == config


def test_a_checkpoint_without_its_tokenizer_file_names_where_the_tokenizer_comes_from(tmp_path):
    folder = tmp_path / "sdar"
    shutil.copytree(FIXTURES / "sdar", folder)
    (folder / "tokenizer.json").unlink()
    config = parse_pipeline_config(_preset(folder, folder))
    with pytest.raises(StageError, match=r"^the pretrained checkpoint's tokenizer.json: '.*sdar/tokenizer.json' does "
                                         r"not exist; copy the checkpoint's tokenizer.json there, or set \[tokenizer\] "
                                         r"path"):
        check_adopted(config)


def test_an_export_keeps_the_released_dtype(tmp_path):
    """A checkpoint released in bfloat16 trains in float32 master weights and exports in bfloat16,
    at its own size (it came back float32, twice the bytes, with another torch_dtype)."""
    from bd_train.stages import RunDir

    folder = tmp_path / "sdar"
    shutil.copytree(FIXTURES / "sdar", folder)
    raw = read_hf_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    config = parse_pipeline_config({**_preset(folder, folder), "run": {"output_dir": str(tmp_path / "runs")}})
    run = Run(config, RunDir.create(config, run_id="export"))
    model = run.pretrained_model("student")
    assert {x.dtype for x in jax.tree.leaves(model)} == {np.dtype("float32")}
    exported = run.export(model, "sft-student", "student")
    assert read_hf_config(exported)["torch_dtype"] == "bfloat16"
    again = from_pretrained(exported, param_dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b.astype("bfloat16")))


def test_a_lora_stage_on_another_lora_stage_resumes_on_another_mesh(tmp_path):
    """A LoRA stage whose base is another LoRA stage's checkpoint pins that base by what the
    checkpoint holds (its adapters' saved digests and its own base's pin), not by the merged
    model's bits, which differ between meshes in float32: read back on one device and on a
    (1, 4, 2) mesh, the pins are equal, so a resume on either is accepted; other adapters are
    still refused."""
    from bd_core import FingerprintMismatch
    from bd_models import make_mesh
    from bd_train import Checkpointer, TrainState

    preset = _preset(FIXTURES / "sdar", FIXTURES / "sdar")
    preset["student"]["lora"] = {"rank": 2, "stages": ["sft", "opd"]}
    run = Run(parse_pipeline_config(preset))
    config, identity, lora = run.model_config("student"), run.identity("student"), run.lora("student", "sft")

    def trained(seed: int):  # adapters away from their start: B no longer zero
        model = run.adapt(run.pretrained_model("student"), lora, "sft-student")
        return jax.tree_util.tree_map_with_path(
            lambda p, x: 0.05 * jax.random.normal(jax.random.key(seed), x.shape, x.dtype)
            if jax.tree_util.keystr(p).endswith("lora_b") else x, model)

    for name, seed in (("sft-student", 7), ("other", 8)):
        with Checkpointer(tmp_path / name) as checkpoints:
            checkpoints.save(TrainState.init(trained(seed), _optimizer(), key=jax.random.key(0)),
                             fingerprints={"identity": identity,
                                           **run.adapters_pin(trained(seed), lora, {"pretrained": "student"})})
    sft = str(tmp_path / "sft-student")
    single = run.restore_model(sft, config, identity, what="SFT")
    sharded = run.restore_model(sft, config, identity, what="SFT", mesh=make_mesh(1, 4, 2))
    opd = run.lora("student", "opd")
    pins = [run.adapters_pin(model, opd, {"checkpoint": sft}) for model in (single, sharded)]
    assert pins[0]["adapters"] == pins[1]["adapters"]
    with Checkpointer(tmp_path / "opd") as checkpoints:
        checkpoints.save(TrainState.init(run.adapt(sharded, opd, "opd"), _optimizer(), key=jax.random.key(0)),
                         fingerprints={"identity": identity, **pins[1]})
        checkpoints.check_fingerprints({"identity": identity, **pins[0]})
        restored = run.restore_model(tmp_path / "opd", config, identity, what="OPD")
        assert restored.config == config
        other = run.adapters_pin(single, opd, {"checkpoint": str(tmp_path / "other")})
        with pytest.raises(FingerprintMismatch, match="adapters.base_digest"):
            checkpoints.check_fingerprints({"identity": identity, **other})
    # A checkpoint that pinned the merged bits, as bdlm did before, still resumes and restores on
    # the layout that made it: the driver takes the pin in its saved form when those bits agree.
    from bd_core import fingerprint
    from bd_models import weights_digest
    from bd_train.stages._driver import _as_saved

    adapted = run.adapt(single, opd, "opd")
    legacy = fingerprint({**pins[0]["adapters"].fields, "base_digest": weights_digest(single)})
    with Checkpointer(tmp_path / "opd-legacy") as checkpoints:
        checkpoints.save(TrainState.init(adapted, _optimizer(), key=jax.random.key(0)),
                         fingerprints={"identity": identity, "adapters": legacy})
        resumed = _as_saved({"identity": identity, **pins[0]}, checkpoints.fingerprints(), adapted)
        assert resumed["adapters"] == legacy
        checkpoints.check_fingerprints(resumed)
    assert run.restore_model(tmp_path / "opd-legacy", config, identity, what="OPD").config == config
