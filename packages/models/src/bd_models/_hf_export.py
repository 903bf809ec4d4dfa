"""Writing a `BlockDiffusionLM` as a Hugging Face checkpoint folder: config.json in the 4.x form
and safetensors in the file names and layouts `_hf_io` reads, in shards with an index past a
size, in the dtype asked, with a note of where the weights came from."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._hf_config import ARCHITECTURES, PretrainedError, hf_config
from ._hf_io import _LAYER, _TOP, INDEX, SINGLE, _file_names
from ._model import BlockDiffusionLM
from ._sharding import to_host


def _named_tensors(model: BlockDiffusionLM) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(file name, a thunk giving the tensor) in file order, one tensor on the host at a time."""
    config = model.config
    table = _file_names(config)
    for name, (leaf, layer) in table.items():
        transposed = (_LAYER if layer >= 0 else _TOP)[leaf][1]
        source = getattr(model, leaf) if layer < 0 else getattr(model.layers, leaf)

        def get(source=source, layer=layer, transposed=transposed) -> np.ndarray:
            value = to_host(source[layer] if layer >= 0 else source)
            return np.ascontiguousarray(value.T if transposed else value)

        yield name, get


SOURCE = "bdlm_source.json"
PARTIAL = ".partial-export"  # where an export is written before it is moved up


EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what `save_pretrained` writes tensors in


def save_pretrained(model: BlockDiffusionLM, path: str | Path, *, model_type: str | None = None,
                    base_config: Mapping[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30,
                    source: Mapping[str, Any] | None = None, dtype: str | None = None) -> Path:
    """Write `model` as a Hugging Face checkpoint folder: config.json (4.x form) and safetensors,
    split into `model-0000i-of-0000n.safetensors` with an index past `max_shard_bytes`. The tensors
    are in `dtype` (`float32`, `bfloat16` or `float16`; default the model's parameter dtype): a
    bfloat16 release imported with float32 master weights (`from_pretrained`'s default) exports at
    its own size with `dtype="bfloat16"`.
    `model_type` defaults to `base_config`'s (the imported checkpoint's, whose other keys are kept)
    or to the layout the model's options imply (`qwen3`, `qwen2`, `llama`). With several processes,
    every process must call it (tensors are gathered); process 0 writes. `source` (JSON-ready: where
    the weights came from, e.g. a Hub repo and commit, and what trained them) is written beside as
    `bdlm_source.json`, so an export says what it is. The export is written whole inside `path`
    first and then moved up by renames (other files already in `path` kept): one that fails part
    way leaves `path` as it was."""
    from ._hf_config import _layout_for
    from ._lora import has_adapters

    if has_adapters(model):
        raise PretrainedError("save_pretrained: the model carries LoRA adapters; export merge(model) (the adapters "
                              "folded into the weights) instead")
    config = model.config
    model_type = model_type or (base_config or {}).get("model_type") or _layout_for(config)
    if model_type not in ARCHITECTURES:
        raise PretrainedError(f"save_pretrained: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    writer = jax.process_index() == 0
    torch_dtype = dtype or config.param_dtype
    if torch_dtype not in EXPORT_DTYPES:
        raise PretrainedError(f"save_pretrained: dtype {torch_dtype!r} is not one of {list(EXPORT_DTYPES)}")
    content = hf_config(config, model_type, base=base_config, torch_dtype=torch_dtype)
    final = Path(path)
    if writer and final.exists() and not final.is_dir():
        raise PretrainedError(f"save_pretrained: {str(final)!r} is a file; give a folder to write the checkpoint in")
    # Written whole in a folder inside the destination (the same disk, whatever links lead there),
    # then moved up by renames: an export that fails or is killed part way leaves the files as
    # they were (and the next export removes what it left).
    partial = final / PARTIAL
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    try:
        _write(model, partial, writer, content, torch_dtype, max_shard_bytes, source)
        if writer:
            _move_up(partial, final)
    finally:
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
    return final


def _write(model: BlockDiffusionLM, path: Path, writer: bool, content: dict, torch_dtype: str, max_shard_bytes: int,
           source: Mapping[str, Any] | None) -> None:
    from safetensors.numpy import save_file

    if writer and source is not None:
        (path / SOURCE).write_text(json.dumps(dict(source), indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size, total, weight_map = 0, 0, {}
    files: list[str] = []

    def flush():
        if shards[-1] and writer:
            name = f"part-{len(files)}"
            save_file(shards[-1], str(path / (name + ".tmp")), metadata={"format": "pt"})
            files.append(name)
        elif shards[-1]:
            files.append(f"part-{len(files)}")
        shards[-1] = {}

    for name, get in _named_tensors(model):
        value = get()
        value = value if value.dtype == jnp.dtype(torch_dtype) else value.astype(jnp.dtype(torch_dtype))
        if size and size + value.nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = value
        weight_map[name] = len(files)
        size += value.nbytes
        total += value.nbytes
    flush()
    if writer:
        n = len(files)
        final = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for tmp, name in zip(files, final):
            (path / (tmp + ".tmp")).rename(path / name)
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
            (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (path / "config.json").write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _move_up(written: Path, final: Path) -> None:
    """The export in `written` replaces the one in `final`: the earlier weights, index and source
    note are removed, the new ones moved up, config.json last. Other files of `final` (a
    tokenizer, a README) stay."""
    for old in [*final.glob("model*.safetensors"), final / INDEX, final / SOURCE]:
        if not (written / old.name).exists():
            old.unlink(missing_ok=True)
    for new in sorted(written.iterdir(), key=lambda p: p.name == "config.json"):
        new.replace(final / new.name)
