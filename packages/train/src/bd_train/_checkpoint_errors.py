"""How a checkpoint refuses: the errors a restore raises (a checkpoint missing or asked for
wrongly, damaged files, another tree), the shard names and region keys their messages use, and
the quieting of the reads a failed restore leaves behind, so that the message is what is seen.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or was asked for in a way that cannot work."""


class CheckpointCorrupted(CheckpointError):
    """A checkpoint whose files cannot be read, or no longer hold what was saved; `cause` says
    what could not be read, where a read failed."""

    cause: str = ""


class CheckpointMismatch(CheckpointError):
    """The saved tree differs from the target; `differences` maps leaf path -> (saved, target)."""

    def __init__(self, differences: Mapping[str, tuple[Any, Any]], context: str):
        self.differences = dict(differences)
        lines = [f"  {path}: saved {saved}, target {target}"
                 for path, (saved, target) in sorted(self.differences.items())]
        super().__init__(
            f"{context}: the saved tree differs from the target in {len(lines)} leaf/leaves:\n" + "\n".join(lines)
            + "\nBuild the target with the config the checkpoint was made with, or start from a matching checkpoint."
        )


def named(shards: Sequence[tuple[str, str]]) -> str:
    """`a/b (shard 0:4,0:8), c (shard 0:2)` for at most 8 shards, then how many more."""
    names = ", ".join(f"{path} (shard {key or '()'})" for path, key in shards[:8])
    return names + (f" and {len(shards) - 8} more" if len(shards) > 8 else "")


_SLICE = re.compile(r"\(?slice\((-?\d+|None), (-?\d+|None), (?:-?\d+|None)\)\)?,?\s*")


def plain(text: str) -> str:
    """An error text with its Python `slice(...)` tuples written as region keys (`0:1,0:64`)."""
    def region(match: re.Match) -> str:
        parts = _SLICE.findall(match.group(0))
        return ",".join(f"{'' if a == 'None' else a}:{'' if b == 'None' else b}" for a, b in parts)

    return re.sub(r"\((?:slice\([^)]*\),?\s*)+\)", region, text)


def quiet_reads_left_behind() -> None:
    """A restore that fails leaves TensorStore reads in flight. Each reports its end to the event
    loop Orbax ran the restore on, which is closed by then: Python prints that `RuntimeError('Event
    loop is closed')` as an unraisable exception, and asyncio logs a failed read's future or task as
    "... exception was never retrieved", during the restore, seconds later or at exit: screens
    of tracebacks around the message that says what is damaged. Called before every restore, this
    drops those two reports (the second only for TensorStore's errors); every other unraisable
    exception and log record goes where it went before."""
    previous = sys.unraisablehook
    if getattr(previous, "_bdlm_quiet", False):
        return

    def hook(report: Any) -> None:
        if not (isinstance(report.exc_value, RuntimeError) and str(report.exc_value) == "Event loop is closed"):
            previous(report)

    hook._bdlm_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_not_left_behind)  # once: a logger keeps one of each filter


def _not_left_behind(record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not (text.startswith(("Future exception was never retrieved", "Task exception was never retrieved"))
                and "tensorstore" in text.lower())
