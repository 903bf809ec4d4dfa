"""The JSON items a checkpoint step keeps beside its arrays: the versions it was written with, and
the metadata of an asynchronous save, whose array digests are computed inside Orbax's commit
(`meta_handler`), so a step is renamed from its temp dir only once they are written; and the data
pipeline's positions (`data_state_whole`).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

_VERSIONED = ("bd-core", "bd-data", "bd-models", "bd-train", "jax", "equinox", "optax", "orbax-checkpoint", "grain")


def versions() -> dict[str, str]:
    """The installed versions of the packages a checkpoint depends on, by distribution name."""
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


@dataclasses.dataclass
class PendingMeta:
    """A save's JSON metadata whose digests are computed when Orbax writes the item, on its
    background thread, by `digests` (over the host copies taken at save, which it holds)."""

    meta: dict[str, Any]
    digests: Callable[[], Any] | None

    def resolve(self) -> dict[str, Any]:
        digests, self.digests = self.digests, None  # the host copies are released once digested
        if digests is None:
            raise RuntimeError("the metadata of an asynchronous save was written twice")  # a bug, not a user's
        return {**self.meta, "digests": digests()}


def meta_handler() -> ocp.JsonCheckpointHandler:
    """Orbax's JSON handler (its type is what `JsonSave`/`JsonRestore` are registered with, so
    restores need nothing else) whose write first resolves a `PendingMeta`: the digests are
    computed inside the commit, and the step is renamed from its temp dir only once they are
    written."""
    handler = ocp.JsonCheckpointHandler()
    write = handler._save_fn  # orbax-checkpoint 0.12: the coroutine its commit thread runs

    async def save_fn(item: Any, directory: Any) -> None:
        await write(item.resolve() if isinstance(item, PendingMeta) else item, directory)

    handler._save_fn = save_fn  # type: ignore[method-assign]
    return handler


def data_state_whole(folder: str) -> bool:
    """Whether a step's data-pipeline positions (grain's JSON, one file per process) are all there
    and readable: then a position that cannot be set is another pipeline's, not damage."""
    files = glob.glob(os.path.join(folder, "process_*.json"))
    try:
        return bool(files) and all(isinstance(json.loads(Path(f).read_text(encoding="utf-8")), dict) for f in files)
    except (OSError, ValueError):
        return False
