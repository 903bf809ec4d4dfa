"""The progress watchdog of a process group: a stage's update loop that makes no progress for
max(`factor` x the median update time, `floor_s`) ends the group with `EXIT_LOST`.

The heartbeat (`_distributed`) goes on while a collective waits forever on a process that hangs,
so progress is watched instead: each process's loop marks where it is (`mark(phase, step)`), a
thread publishes that through the coordinator's key-value store, and every process checks every
process's mark. The first to see one unchanged too long writes its verdict to the store; each
process then dumps every thread's stack into `<run>/stacks/<stage>-process<i>.txt`, prints one
line naming the stage, the step and the process furthest behind, and exits 75, so a scheduler
restarts the group from its last complete checkpoint. The first update of a stage (it compiles)
and evaluation are not watched (a loop that marks "evaluating" is not timed until it marks again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import jax

STALL_FACTOR_ENV = "BDLM_STALL_FACTOR"
"""The environment variable that overrides `[run] stall_factor` (0 turns the watchdog off)."""
STALL_FLOOR_ENV = "BDLM_STALL_FLOOR_S"
"""The environment variable that overrides `[run] stall_floor_s`."""
STALLED_KEY = "bdlm/stalled"
# Where a loop can be, in the order one update passes through them (`_RANK`): an update that
# begun after step s, its programs dispatched, done at step s', then saving s'.
_RANK = {"done": 0, "evaluating": 1, "saving": 2, "update": 3, "dispatched": 4}
_SAY = {"update": "in the update after step {}", "dispatched": "waiting on the update after step {}",
        "done": "after step {}", "evaluating": "evaluating at step {}", "saving": "saving step {}"}

Mark = Callable[[str, int], None]


@dataclasses.dataclass(frozen=True)
class StallPolicy:
    """How long a loop may go without progress: max(`factor` x the median update time, `floor_s`);
    `factor = 0` turns the watchdog off."""

    factor: float = 10.0
    floor_s: float = 300.0

    def __post_init__(self):
        from ._distributed import DistributedError

        if self.factor != 0 and not self.factor >= 2:
            raise DistributedError(f"stall_factor = {self.factor}: give 0 (no watchdog) or at least 2 (an update "
                                   "may take twice the median on a busy host)")
        if not self.floor_s >= 1:
            raise DistributedError(f"stall_floor_s = {self.floor_s}: give at least 1 second")

    @classmethod
    def resolve(cls, factor: float, floor_s: float, environ: os._Environ | dict | None = None) -> StallPolicy:
        """The preset's values, each overridden by `BDLM_STALL_FACTOR` / `BDLM_STALL_FLOOR_S` when set."""
        from ._distributed import DistributedError

        environ = os.environ if environ is None else environ
        values = {"factor": factor, "floor_s": floor_s}
        for name, env in (("factor", STALL_FACTOR_ENV), ("floor_s", STALL_FLOOR_ENV)):
            if environ.get(env):
                try:
                    values[name] = float(environ[env])
                    cls(**{name: values[name]})
                except (ValueError, DistributedError) as err:
                    why = str(err) if isinstance(err, DistributedError) else "expected a number"
                    raise DistributedError(f"{env}={environ[env]!r}: {why}; fix or unset it") from None
        return cls(**values)

    def allowance(self, median_s: float) -> float:
        """Seconds without progress before a stall: max(factor × `median_s`, floor)."""
        return max(self.factor * median_s, self.floor_s)


class Watchdog(threading.Thread):
    """One process's watch over its group's progress in one stage (a daemon thread)."""

    def __init__(self, stage: str, policy: StallPolicy, stacks_dir: Path, client, *, interval: float = 1.0):
        super().__init__(name="bdlm-progress-watchdog", daemon=True)
        self.stage, self.policy, self.stacks_dir, self.client = stage, policy, Path(stacks_dir), client
        self.me, self.n = jax.process_index(), jax.process_count()
        self.interval = min(interval, policy.floor_s / 4)
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.where: tuple[str, int] | None = None  # this process's latest mark
        self.marked = time.monotonic()
        self.done_at: list[float] = []  # when each update ended: their gaps make the median

    def mark(self, phase: str, step: int) -> None:
        """Where this process's loop is now (the main thread calls it; no I/O here)."""
        now = time.monotonic()
        with self.lock:
            self.where, self.marked = (phase, step), now
            if phase == "done":
                self.done_at.append(now)

    def median(self) -> float:
        """The median seconds between completed updates so far (0 before two)."""
        with self.lock:
            gaps = [b - a for a, b in zip(self.done_at, self.done_at[1:])]
        return statistics.median(gaps) if gaps else 0.0

    def run(self) -> None:
        """The watchdog thread's loop: publish progress, compare with the others', and stop every process on a stall."""
        seen: dict[int, tuple[str | None, float]] = {}
        published = None
        while not self.finished.wait(self.interval):
            try:
                verdict = _try_get(self.client, STALLED_KEY)
                if verdict is not None:
                    self._stop(verdict)
                with self.lock:
                    where, armed = self.where, bool(self.done_at)
                if where is not None and where != published:
                    self.client.key_value_set(f"bdlm/progress/{self.me}", f"{self.stage}|{where[0]}|{where[1]}",
                                              allow_overwrite=True)
                    published = where
                if not armed:  # the stage's first update compiles: its time says nothing
                    continue
                self.client.key_value_set(f"bdlm/frame/{self.me}", _main_frame(), allow_overwrite=True)
                now = time.monotonic()
                values = {p: _try_get(self.client, f"bdlm/progress/{p}") for p in range(self.n)}
                evaluating = any((value or "").split("|")[1:2] == ["evaluating"] for value in values.values())
                for p, value in values.items():
                    if p not in seen or seen[p][0] != value or evaluating:
                        seen[p] = (value, now)
                median = self.median()
                allowed = self.policy.allowance(median)
                silent = max(now - since for _, since in seen.values())
                if silent > allowed:
                    self._decide(values, silent, allowed, median)
            except Exception:  # noqa: BLE001,S112  (the coordinator is gone: the heartbeat's watch says so)
                continue

    def _decide(self, values: dict[int, str | None], silent: float, allowed: float, median: float) -> None:
        places, frames = {}, {}
        for p, value in values.items():
            stage, phase, step = (value or f"{self.stage}|update|-1").split("|")
            frame = _try_get(self.client, f"bdlm/frame/{p}") or "1|?"
            frames[p] = frame.split("|", 1)
            # Furthest behind in the loop first; among equals, one whose main thread is outside
            # JAX (host code: data, I/O, a lock) holds up the others, who wait inside JAX's collectives.
            places[p] = (int(step), _RANK.get(phase, 0), frames[p][0] == "1", phase)
        behind = min(places.values())[:3]
        slowest = [p for p, place in places.items() if place[:3] == behind]
        where = "; ".join(f"process {p} {_SAY.get(places[p][3], '{}').format(places[p][0])} "
                          f"({'inside JAX' if frames[p][0] == '1' else 'outside JAX'}, at {frames[p][1]})"
                          for p in sorted(places))
        who = (f"the slowest: process {slowest[0]}" if len(slowest) == 1
               else f"processes {', '.join(map(str, slowest))} equally far")
        verdict = (f"{self.stage} made no progress for {silent:.0f} s at step {min(p[0] for p in places.values())} "
                   f"(allowed: max({self.policy.factor:g} x the median update {median:.2f} s, "
                   f"{self.policy.floor_s:g} s)); {who} ({where})")
        try:
            self.client.key_value_set(STALLED_KEY, verdict, allow_overwrite=False)
        except Exception:  # noqa: BLE001  (another process wrote its verdict first: say that one)
            verdict = _try_get(self.client, STALLED_KEY) or verdict
        self._stop(verdict)

    def _stop(self, verdict: str) -> None:
        from ._distributed import EXIT_LOST

        # Each process says it has the verdict, and none leaves before every other has it (or a few
        # intervals passed): a process that left first would break the others' collectives, and
        # they would end on that error instead of dumping their stacks.
        deadline = time.monotonic() + 5 * self.interval + 2
        with contextlib.suppress(Exception):  # the coordinator gone: nobody to wait for
            self.client.key_value_set(f"bdlm/stalled-seen/{self.me}", "1", allow_overwrite=True)
            while time.monotonic() < deadline and not all(_try_get(self.client, f"bdlm/stalled-seen/{p}")
                                                          for p in range(self.n)):
                time.sleep(self.interval / 4)
        path = self.stacks_dir / f"{self.stage}-process{self.me}.txt"
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as out:
                out.write(f"bdlm: {verdict}\nprocess {self.me}, every thread:\n\n")
                out.flush()
                # faulthandler's (it needs no lock, but keeps each thread's innermost 100 frames,
                # which inside JAX can hide the loop that called it), then every thread whole
                faulthandler.dump_traceback(out, all_threads=True)
                out.write("\nevery thread, whole (most recent call last):\n")
                for ident, frame in sys._current_frames().items():
                    out.write(f"\nthread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))
        except OSError as err:
            path = f"(not written: {err})"
        sys.stderr.write(f"\nbdlm: {verdict}. Every thread's stack of process {self.me}: {path}. The group stops "
                         f"(exit {EXIT_LOST}): restart it with `resume` (the flow's `resume`, or the same stages "
                         "again) to continue from the last complete checkpoint.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_LOST)

    def close(self) -> None:
        """Stop the watchdog thread."""
        self.finished.set()


def _main_frame() -> str:
    """`<1 if inside JAX else 0>|<file>:<line> <function>` of the main thread's innermost frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "0|?"
    code = frame.f_code
    inside = any(f"{os.sep}{name}{os.sep}" in code.co_filename for name in ("jax", "jaxlib", "equinox"))
    return f"{int(inside)}|{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"


def _try_get(client, key: str) -> str | None:
    from ._distributed import _try_get as try_get

    return try_get(client, key)


@contextlib.contextmanager
def watch_progress(stage: str, policy: StallPolicy, stacks_dir: Path) -> Iterator[Mark | None]:
    """Watch the loop inside (it calls the yielded `mark(phase, step)`) in a group of processes;
    yields None in a single process or with `policy.factor == 0`."""
    from jax._src import distributed  # the coordinator's client: its key-value store has no public handle

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1 or policy.factor == 0:
        yield None
        return
    watchdog = Watchdog(stage, policy, stacks_dir, client)
    watchdog.start()
    try:
        yield watchdog.mark
    finally:
        watchdog.close()
