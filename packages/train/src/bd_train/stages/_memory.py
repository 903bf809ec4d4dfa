"""The accelerator's memory at a stage's phases: the allocator's bytes in use and its peak so far,
read where the backend keeps statistics (TPU and GPU; a CPU keeps none, and nothing is recorded),
and on a TPU the peak of what its runtime reserved for compiled programs (other backends report
none, or 0).

The peak is the process's since it began, so it only grows: the first phase whose peak equals the
stage's last is where the stage reached it (`MemoryLog.peaked_in`). In a process that runs several
stages (`python -m bd_train.stages run`), a stage that never rose above an earlier stage's peak
names its first phase, `state`, which also holds whatever the process did before the stage (a
rerun restores the finished stages first). A plan (`bd_train.plan`) gives each program's peak;
these readings are what the whole stage held, its state, evaluation and the adapters' merge
included, as far as the allocator counts it. A TPU's runtime keeps a compiled program's
temporaries apart, in its reserved bytes: on a v5e (jax 0.10.2's libtpu) a train step's
`peak_bytes_in_use` held its arguments and `peak_bytes_reserved` 0.97-0.99 GiB less than the
temporaries XLA assigns it (SCALING.md), so a TPU's readings carry `reserved_peak_gib` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

GiB = float(1 << 30)


def device_memory(device: Any = None) -> dict[str, float] | None:
    """`{"in_use_gib", "peak_gib"}` of `device` (default: this process's first), with
    `"reserved_peak_gib"` where the runtime reserves programs' temporaries apart (a TPU's
    `peak_bytes_reserved`), or None where its backend keeps no statistics."""
    stats = (device if device is not None else jax.local_devices()[0]).memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    reading = {"in_use_gib": stats["bytes_in_use"] / GiB,
               "peak_gib": stats.get("peak_bytes_in_use", stats["bytes_in_use"]) / GiB}
    if stats.get("peak_bytes_reserved"):  # other backends report 0, or nothing
        reading["reserved_peak_gib"] = stats["peak_bytes_reserved"] / GiB
    return reading


class MemoryLog(dict[str, dict[str, float]]):
    """`{phase: device_memory()}` in the order the phases were marked."""

    def __init__(self, read: Callable[[], dict[str, float] | None] = device_memory) -> None:
        super().__init__()
        self._read = read

    def mark(self, phase: str, *ready: Any) -> None:
        """Read the device once `ready`'s arrays are computed, and keep it as `phase` (nothing
        where there is nothing to read): work still in flight would count in a later phase."""
        jax.block_until_ready(ready)
        reading = self._read()
        if reading is not None:
            self[phase] = reading

    def summary(self) -> dict[str, float]:
        """The run summary's `memory/*`: the peak by the last phase (and the reserved peak, on a
        TPU) and the GiB in use at each phase."""
        last = list(self.values())[-1]
        return {"memory/peak_gib": last["peak_gib"],
                **({"memory/reserved_peak_gib": last["reserved_peak_gib"]} if "reserved_peak_gib" in last else {}),
                **{f"memory/{phase.replace(' ', '_')}_gib": r["in_use_gib"] for phase, r in self.items()}}

    def peaked_in(self) -> str | None:
        """The first phase, in the stage's order, whose peak is the stage's (`peaked_in`)."""
        return peaked_in(self)


PHASES = ("state", "first update", "trained", "merged", "evaluated")  # the order a stage marks them


def peaked_in(memory: Mapping[str, Mapping[str, float]] | None) -> str | None:
    """The first phase whose peak is the stage's: where the stage reached it. Phases are taken in
    the order a stage marks them (`PHASES`, others after them), not the mapping's, so readings
    kept as JSON with sorted keys place the peak as the stage did."""
    if not memory:
        return None
    ordered = sorted(memory, key=lambda phase: PHASES.index(phase) if phase in PHASES else len(PHASES))
    peak = max(reading["peak_gib"] for reading in memory.values())
    return next(phase for phase in ordered if memory[phase]["peak_gib"] >= peak)
