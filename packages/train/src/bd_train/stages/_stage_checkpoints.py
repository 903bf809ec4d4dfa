"""A stage's checkpoint folder opened in the preset's terms, the content pin of a LoRA stage's
checkpoint, and arrays committed as a restored checkpoint's are."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax

from .._checkpoint import Checkpointer, CheckpointError
from ._errors import StageError


def adapted_checkpoint_digest(directory: str | Path) -> str | None:
    """For a LoRA stage's checkpoint (adapters on a base it pins), a digest of what it holds: the
    content digests its latest step recorded for the adapters, and its own base's pin, so a chain
    of LoRA stages is pinned link by link by content. Merged, its model's bits depend on the
    mesh and backend that merged it, so they cannot pin it. None for any other checkpoint (its
    restored weights are the same bits on any layout: `weights_digest` pins them)."""
    checkpoints = open_checkpoints(directory, create=False)
    try:
        meta = checkpoints.read_meta()
    except CheckpointError as err:
        raise StageError(str(err)) from None
    finally:
        checkpoints.close()
    adapters = (meta.get("fingerprints") or {}).get("adapters")
    if adapters is None:
        return None
    model = {path: shards for path, shards in sorted((meta.get("digests") or {}).items()) if path.startswith("model/")}
    record = {"step": int(meta["step"]), "model": model, "adapters": adapters}
    return "saved:" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def open_checkpoints(directory: str | Path, *, create: bool, max_to_keep: int | None = 2,
                     async_save: bool = False) -> Checkpointer:
    """A stage's checkpoint folder; without `create` one that must hold a stage's checkpoints, refused
    in the preset's terms (a missing folder, one step's folder given for the stage's)."""
    folder = Path(directory)
    if not create and not folder.is_dir():
        raise StageError(f"checkpoint folder {str(folder)!r} does not exist; give a stage's checkpoint folder "
                         f"(<output_dir>/pipeline/<run-id>/checkpoints/<stage>)")
    if not create and folder.name.isdigit() and (folder / "meta").is_dir():
        raise StageError(f"{str(folder)!r} is one step of the checkpoint folder {str(folder.parent)!r}; give that "
                         f"folder (its latest complete step is used)")
    try:
        return Checkpointer(directory, max_to_keep=max_to_keep, create=create, async_save=async_save)
    except CheckpointError as err:
        raise StageError(str(err)) from None


def committed(tree: Any) -> Any:
    """`tree`'s arrays committed to the default device, as a restored checkpoint's are. A program
    compiled for committed arguments differs from one for uncommitted arguments (it carries their
    shardings), so a stage that starts from fresh or imported weights would otherwise compile its
    sampler and evaluation anew for the next stage, which starts from the saved checkpoint (and
    miss JAX's persistent compilation cache)."""
    device = jax.local_devices()[0]
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree)
