"""`from_pretrained`: Hugging Face checkpoints (config.json + safetensors, single file or sharded
with its index) in, through safetensors' numpy API (no torch); `_hf_export` writes them out.

Import builds every parameter straight into its shards: each device's shard is read from the files
as a slice (`safe_open(...).get_slice`), so besides the parameters a host holds one leaf's slices
at a time, on any number of processes (bench/import_memory.py measures it). Linear weights are
stored `[out, in]` in the files and `[in, out]` here; per-layer tensors are stacked on the leading
layer axis. Added tokens (a mask token) get embedding (and untied head) rows equal to the mean of
the existing rows. Export (`save_pretrained`) writes the same names back, sharded past
`max_shard_bytes`; import -> export -> import is bit-exact.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from bd_core import resolve_pretrained

from ._config import ModelConfig
from ._hf_config import PretrainedError, model_config_from_hf
from ._model import BlockDiffusionLM
from ._sharding import check_divisibility, param_partition_specs

# Our leaf -> (its name in the file, stored transposed). Layer names get "model.layers.{i}." first.
_LAYER = {
    "attn_norm": ("input_layernorm.weight", False), "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_TOP = {"embedding": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
        "lm_head": ("lm_head.weight", True)}
_VOCAB_ROWS = ("embedding", "lm_head")  # leaves whose vocabulary axis may grow
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _is_orbax(path: Path) -> bool:
    """Whether `path` is an Orbax checkpoint folder (its step folders) or one of its steps."""
    steps = [path, *(p for p in path.iterdir() if p.name.isdigit())]
    return any((step / "_CHECKPOINT_METADATA").is_file() for step in steps)


def read_hf_config(path: str | Path, *, revision: str | None = None) -> dict[str, Any]:
    """The `config.json` of a checkpoint folder or Hub repo id (at `revision`) as a dict; a missing or
    malformed file is one `PretrainedError`."""
    path = resolve_pretrained(path, revision).folder
    file = path / "config.json"
    if path.is_file():
        raise PretrainedError(f"{str(path)!r} is a file; pass the folder that holds it, {str(path.parent)!r} "
                              f"(config.json and the *.safetensors files)")
    if not path.is_dir():
        raise PretrainedError(f"checkpoint folder {str(path)!r} does not exist; pass the folder that holds "
                              f"config.json and the *.safetensors files")
    if not file.is_file():
        if _is_orbax(path):
            raise PretrainedError(f"{str(path)!r} is a bdlm stage checkpoint (Orbax steps), not a Hugging Face "
                                  f"folder: a preset adopts it as [teacher] / [student] checkpoint = ..., and a "
                                  f"stage exports a Hugging Face copy with [run] export = true")
        raise PretrainedError(f"{str(file)!r} is missing: a Hugging Face checkpoint folder has a config.json beside "
                              f"its weights; copy it from the checkpoint's source")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PretrainedError(f"{str(file)!r} is not valid JSON ({err}); restore the file") from None
    if not isinstance(raw, dict):
        raise PretrainedError(f"{str(file)!r} holds a {type(raw).__name__}, not a JSON object; restore the file")
    return raw


def checkpoint_digest(path: str | Path) -> str:
    """A short digest of a checkpoint folder that changes with its config, its tensor names,
    shapes, dtypes and file sizes (the safetensors headers), without reading the weights."""
    import hashlib

    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            digest.update(file.name.encode() + handle.read(min(size, 100_000_000)))
        digest.update(str(file.stat().st_size).encode())
    return digest.hexdigest()[:16]


class _Tensors:
    """Every tensor of a checkpoint folder by name: (file, shape) from the headers, and slices
    read on demand. Each read opens its file anew: safetensors maps files into memory, and pages
    touched through a mapping held open for the whole import would count as the process's
    memory until the end (measured: the peak doubled, file pages on top of the parameters)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise PretrainedError(f"{str(index)!r} is not a safetensors index (no weight_map: {err}); restore "
                                      f"the file") from None
            files = sorted(set(weight_map.values()))
        elif (path / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise PretrainedError(f"{str(path)!r} has neither {SINGLE} nor {INDEX}; bdlm reads safetensors weights "
                                  f"(convert .bin/.pt checkpoints with transformers' save_pretrained first)")
        self.path = path
        self.where: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise PretrainedError(f"shard {str(file)!r} named in {INDEX} is missing; download or copy every "
                                      f"shard the index lists")
            try:
                with safe_open(str(file), framework="numpy") as handle:
                    shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
            except Exception as err:  # safetensors raises its own error type for a damaged header or size
                raise PretrainedError(f"{str(file)!r} is not a readable safetensors file ({err}); it is truncated or "
                                      f"damaged: download or export it again") from None
            for key, shape in shapes.items():
                self.where[key], self.shape[key] = name, shape
        if index.is_file():
            misplaced = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if misplaced:
                raise PretrainedError(f"{str(index)!r} lists tensors its shards do not hold: {misplaced[:5]}; the "
                                      f"folder mixes files of different checkpoints: download it again")

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.path / self.where[name]), framework="numpy") as handle:
            return np.array(handle.get_slice(name)[index], copy=True)


def _file_names(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Every tensor name the files must hold for `config`: (our leaf, its layer or -1)."""
    names = {}
    for leaf, (name, _) in _TOP.items():
        if leaf != "lm_head" or not config.tie_embeddings:
            names[name] = (leaf, -1)
    for leaf, (name, _) in _LAYER.items():
        absent = (leaf in ("q_norm", "k_norm") and not config.qk_norm) or (leaf in ("bq", "bk", "bv")
                                                                            and not config.qkv_bias)
        if absent:
            continue
        for i in range(config.n_layers):
            names[f"model.layers.{i}.{name}"] = (leaf, i)
    return names


def _expected_shape(abstract, leaf: str, layered: bool, file_vocab: int) -> tuple[int, ...]:
    shape = tuple(abstract.shape[1:] if layered else abstract.shape)
    if leaf in _VOCAB_ROWS:
        shape = (file_vocab, shape[1]) if leaf == "embedding" else (shape[0], file_vocab)
    return shape


def _check_tensors(tensors: _Tensors, config: ModelConfig, abstract_leaves: Mapping[str, Any], file_vocab: int,
                   path: Path) -> None:
    """Missing, unexpected and mis-shaped tensors, all named in one error."""
    expected = _file_names(config)
    present = {k for k in tensors.shape if not k.endswith(_IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    wrong = []
    for name, (leaf, layer) in expected.items():
        if name in tensors.shape:
            transposed = (_LAYER if layer >= 0 else _TOP)[leaf][1]
            want = _expected_shape(abstract_leaves[leaf], leaf, layer >= 0, file_vocab)
            want = want[::-1] if transposed else want
            if tensors.shape[name] != want:
                wrong.append(f"{name}: file {list(tensors.shape[name])}, config.json implies {list(want)}")
    listed = lambda names, n: f"{names[:n]}" + (f" (+{len(names) - n} more)" if len(names) > n else "")  # noqa: E731
    problems = [f"missing {listed(missing, 8)}"] if missing else []
    problems += [f"unexpected {listed(unexpected, 8)}"] if unexpected else []
    problems += [f"shape mismatch {listed(wrong, 4)}"] if wrong else []
    if problems:
        raise PretrainedError(f"{str(path)!r}: the tensors do not match config.json ({'; '.join(problems)}); the "
                              f"weights and config.json come from different checkpoints, or tie_word_embeddings is "
                              f"wrong: use the config.json that was saved with these weights")


def _reader(tensors: _Tensors, leaf: str, config: ModelConfig, kept_rows: int, dtype,
            mean_row: Callable[[], np.ndarray]) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback `jax.make_array_from_callback` calls with one shard's index. For the
    vocabulary leaves, rows from `kept_rows` on are `mean_row()`."""
    layered = leaf in _LAYER
    name, transposed = _LAYER[leaf] if layered else _TOP[leaf]
    grows = leaf in _VOCAB_ROWS and config.vocab_size > kept_rows
    vocab_axis = 0 if leaf == "embedding" else 1

    def one(file_name: str, index: tuple[slice, ...]) -> np.ndarray:
        if not grows:
            file_index = index[::-1] if transposed else index
            part = tensors.read(file_name, file_index)
            return part.T if transposed else part
        # Rows (columns for the head) past the file's vocabulary are the mean of its rows.
        rows = range(config.vocab_size)[index[vocab_axis]]
        kept = [r for r in rows if r < kept_rows]
        other = index[1 - vocab_axis]
        file_rows = slice(kept[0], kept[-1] + 1) if kept else slice(0, 0)
        file_index = (file_rows, other) if leaf == "embedding" else (other, file_rows)
        part = tensors.read(file_name, (file_index[::-1] if transposed else file_index))
        part = part.T if transposed else part
        extra = len(rows) - len(kept)
        if extra:
            fill = np.broadcast_to(mean_row()[other].astype(part.dtype), (extra, part.shape[1 - vocab_axis]))
            part = np.concatenate([part, fill if leaf == "embedding" else fill.T], axis=vocab_axis)
        return part

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not layered:
            return one(name, index).astype(dtype, copy=False)
        layers = range(config.n_layers)[index[0]]
        return np.stack([one(f"model.layers.{i}.{name}", index[1:]) for i in layers]).astype(dtype, copy=False)

    return read


def _mean_row(tensors: _Tensors, name: str, rows: int) -> Callable[[], np.ndarray]:
    """The mean over the vocabulary (the file's rows, `[V, D]` for the embedding and the head
    alike) of an embedding-like tensor, read in row chunks, computed once."""
    cache: list[np.ndarray] = []

    def get() -> np.ndarray:
        if not cache:
            total = None
            for start in range(0, rows, 4096):
                chunk = slice(start, min(rows, start + 4096))
                s = np.asarray(tensors.read(name, (chunk, slice(None))), np.float64).sum(axis=0)
                total = s if total is None else total + s
            assert total is not None
            cache.append((total / rows).astype(np.float32))
        return cache[0]

    return get


@dataclasses.dataclass(frozen=True)
class _Opened:
    """A checkpoint folder read up to its weights: the config, the tensors' headers (checked
    against the config), the abstract model and the rows that hold trained tokens."""

    config: ModelConfig
    tensors: _Tensors
    abstract: Any
    leaves: dict[str, Any]
    kept_rows: int


def _open(path: str | Path, revision: str | None, block_size: int | None, vocab_size: int | None,
          new_rows_from: int | None, param_dtype: str, compute_dtype: str | None, overrides: dict[str, Any]) -> _Opened:
    path = resolve_pretrained(path, revision).folder
    raw = read_hf_config(path)
    where = str(path / "config.json")
    file_vocab = int(raw.get("vocab_size", 0))
    if vocab_size is not None and vocab_size < file_vocab:
        raise PretrainedError(f"from_pretrained: vocab_size={vocab_size} is smaller than the checkpoint's "
                              f"{file_vocab}; pass None (keep it) or a larger size (to add tokens)")
    if new_rows_from is not None and not 0 < new_rows_from <= file_vocab:
        raise PretrainedError(f"from_pretrained: new_rows_from={new_rows_from} must be in 1..{file_vocab} (the "
                              f"checkpoint's rows); it is the first id of the added tokens")
    config = model_config_from_hf(raw, where=where, block_size=block_size, vocab_size=vocab_size,
                                  param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    abstract = eqx.filter_eval_shape(lambda: BlockDiffusionLM(config, key=jax.random.key(0)))
    leaves = {str(getattr(p[-1], "name", p[-1])): x for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    tensors = _Tensors(path)
    _check_tensors(tensors, config, leaves, file_vocab, path)
    return _Opened(config, tensors, abstract, leaves, file_vocab if new_rows_from is None else new_rows_from)


def check_pretrained(path: str | Path, *, revision: str | None = None, block_size: int | None = None,
                     vocab_size: int | None = None, new_rows_from: int | None = None, param_dtype: str = "float32",
                     compute_dtype: str | None = None, **overrides: Any) -> ModelConfig:
    """What `from_pretrained` with the same arguments would build, checked without reading the
    weights: the config, and every shard present with every tensor the model needs at its shape
    (a missing, truncated or foreign shard is refused naming its file). Returns the `ModelConfig`.
    Seconds for a released checkpoint: only the files' headers are read."""
    return _open(path, revision, block_size, vocab_size, new_rows_from, param_dtype, compute_dtype, overrides).config


def from_pretrained(path: str | Path, *, revision: str | None = None, block_size: int | None = None,
                    vocab_size: int | None = None,
                    new_rows_from: int | None = None, param_dtype: str = "float32", compute_dtype: str | None = None,
                    mesh: Mesh | None = None, **overrides: Any) -> BlockDiffusionLM:
    """A `BlockDiffusionLM` from a Hugging Face checkpoint folder or Hub repo id (`org/name` at
    `revision`, through the Hub cache: `bd_core.resolve_pretrained`) of Qwen3, SDAR, Qwen2,
    Fast-dLLM v2 or Llama. `block_size` defaults to the config's (SDAR, Fast-dLLM v2) and is required otherwise;
    `vocab_size` larger than the file's grows the embedding (and untied head). Rows from
    `new_rows_from` (default: the file's vocabulary size) on are new tokens: they are set to the
    mean of the rows before them (an added mask token may fall inside a checkpoint's padded rows,
    as it does for Qwen3's 151,936 rows and 151,669 tokens). With `mesh` every parameter is built
    in its shards. `overrides`: ModelConfig run-time fields (attention, q_tile, k_tile, remat).
    `check_pretrained` checks the same without reading the weights."""
    opened = _open(path, revision, block_size, vocab_size, new_rows_from, param_dtype, compute_dtype, overrides)
    config, tensors, kept_rows = opened.config, opened.tensors, opened.kept_rows
    if mesh is not None:
        check_divisibility(config, mesh)
    specs = param_partition_specs(opened.abstract, mesh)
    means: dict[str, Callable[[], np.ndarray]] = {}
    for leaf in _VOCAB_ROWS:
        if leaf in opened.leaves:
            means[leaf] = _mean_row(tensors, _TOP[leaf][0], kept_rows)

    def build(path_, shape_dtype, spec):
        leaf = str(getattr(path_[-1], "name", path_[-1]))
        read = _reader(tensors, leaf, config, kept_rows, shape_dtype.dtype, means.get(leaf, lambda: np.zeros(0)))
        if mesh is None:
            return jnp.asarray(read(tuple(slice(0, n) for n in shape_dtype.shape)))
        return jax.make_array_from_callback(shape_dtype.shape, NamedSharding(mesh, spec),
                                            lambda index: read(tuple(index)))  # pyright: ignore[reportArgumentType]

    arrays, static = eqx.partition(opened.abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    built = jax.tree_util.tree_map_with_path(build, arrays, specs)
    return eqx.combine(built, static)
