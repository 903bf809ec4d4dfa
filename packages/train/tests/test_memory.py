"""The accelerator memory a stage records at its phases (`bd_train.stages._memory`)."""

from __future__ import annotations

import jax

from bd_train.stages import MemoryLog, device_memory, peaked_in
from bd_train.stages._memory import GiB


class _Allocator:
    """A device's `memory_stats()` as PJRT reports it on a TPU or GPU: bytes now and the peak so far."""

    def __init__(self) -> None:
        self.in_use = self.peak = 0

    def hold(self, n_bytes: int) -> None:
        self.in_use += n_bytes
        self.peak = max(self.peak, self.in_use)

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_in_use": self.in_use, "peak_bytes_in_use": self.peak, "bytes_limit": 16 << 30}


def test_a_cpu_keeps_no_statistics_so_nothing_is_recorded():
    assert jax.local_devices()[0].platform == "cpu"
    assert device_memory() is None
    log = MemoryLog()
    log.mark("state")
    assert log == {} and log.peaked_in() is None


def test_phases_are_read_in_order_and_the_peak_is_placed_where_it_was_reached():
    chip = _Allocator()
    log = MemoryLog(lambda: device_memory(chip))
    chip.hold(3 << 30)
    log.mark("state")
    chip.hold(7 << 30)  # the adapters' merge, say: temporaries freed again before the next phase
    chip.hold(-(4 << 30))
    log.mark("merged")
    chip.hold(2 << 30)
    log.mark("evaluated")
    assert list(log) == ["state", "merged", "evaluated"]
    assert log["state"] == {"in_use_gib": 3.0, "peak_gib": 3.0}
    assert log["merged"] == {"in_use_gib": 6.0, "peak_gib": 10.0}
    assert log["evaluated"] == {"in_use_gib": 8.0, "peak_gib": 10.0}
    assert log.peaked_in() == "merged" == peaked_in(dict(log))
    assert log.summary() == {"memory/peak_gib": 10.0, "memory/state_gib": 3.0, "memory/merged_gib": 6.0,
                             "memory/evaluated_gib": 8.0}
    assert device_memory(chip)["in_use_gib"] * GiB == chip.in_use


def test_the_peak_is_placed_in_the_stages_order_even_from_json_with_sorted_keys():
    """Results files sort their keys ("evaluated" < "first update" < "merged" < "state"): the
    phase where the peak was reached is still the first one the stage marked at that peak."""
    import json

    chip = _Allocator()
    log = MemoryLog(lambda: device_memory(chip))
    chip.hold(12 << 30)  # a rerun restores the finished stages before this one's state is built
    chip.hold(-(9 << 30))
    for phase in ("state", "first update", "trained", "merged", "evaluated"):
        log.mark(phase)
    kept = json.loads(json.dumps(dict(log), sort_keys=True))
    assert list(kept)[0] == "evaluated"
    assert peaked_in(kept) == "state" == log.peaked_in()


def test_a_tpus_reserved_bytes_are_kept_beside_the_allocators_peak():
    """A TPU's runtime reserves a compiled program's temporaries apart from the bytes in use."""
    chip = _Allocator()
    stats = chip.memory_stats
    chip.memory_stats = lambda: {**stats(), "bytes_reserved": 6 << 30, "peak_bytes_reserved": 7 << 30}  # type: ignore[method-assign]
    log = MemoryLog(lambda: device_memory(chip))
    chip.hold(3 << 30)
    log.mark("first update")
    assert log["first update"] == {"in_use_gib": 3.0, "peak_gib": 3.0, "reserved_peak_gib": 7.0}
    assert log.peaked_in() == "first update"
    assert log.summary() == {"memory/peak_gib": 3.0, "memory/reserved_peak_gib": 7.0, "memory/first_update_gib": 3.0}
    chip.memory_stats = lambda: {**stats(), "peak_bytes_reserved": 0}  # type: ignore[method-assign]
    assert "reserved_peak_gib" not in device_memory(chip)  # a GPU's runtime reports 0
