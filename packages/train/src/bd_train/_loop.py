"""The training loop: steps, periodic checkpoints and a clean stop on SIGTERM or Ctrl-C.

A SIGTERM (preemption) or a first Ctrl-C (SIGINT) only sets a flag; the loop finishes the current
update, saves it and returns with `preempted=True`, so the process exits normally and a rerun
continues from there. A second Ctrl-C interrupts at once (Python's KeyboardInterrupt), keeping
the checkpoints already saved.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from bd_core import Fingerprint

if TYPE_CHECKING:
    from ._checkpoint import Checkpointer
    from ._trainer import Trainer, TrainState


class _StopFlag:
    """Records SIGTERM and a first SIGINT while installed (main thread only; elsewhere signals
    cannot be caught). A first SIGINT hands SIGINT back to the handler that was there before
    (Python's KeyboardInterrupt, by default), so that a second one interrupts at once. A
    SIGINT the process was started ignoring (a background job's) stays ignored."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.stop = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        self.stop = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])

    def __enter__(self) -> _StopFlag:
        if self.enabled:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS
                              if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)


def _agreed(stop: bool) -> bool:
    """Whether any process got SIGTERM or Ctrl-C: saves are collective, so every process must stop at the
    same update (pods of one job can be signalled an update apart)."""
    if jax.process_count() == 1:
        return stop
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(stop))))


def run_updates(state: TrainState, num_steps: int, update: Callable[[TrainState], tuple[TrainState, Any]], *,
                save: Callable[[TrainState, bool], None],
                on_update: Callable[[TrainState, Any], None] | None = None,
                save_every: int | None = None, handle_sigterm: bool = True,
                progress: Callable[[str, int], None] | None = None) -> tuple[TrainState, bool]:
    """The loop every training driver here shares. Runs `update(state) -> (state, metrics)` until
    `state.step >= num_steps`, calling `on_update(state, metrics)` after each. `save(state, final)`
    runs when an update crosses a multiple of `save_every` (final=False), at the end, and when
    SIGTERM or a first Ctrl-C reached any process (final=True); after one it returns at once with
    `preempted=True` (also when it came after the last update, once the end is saved).
    `progress(phase, step)` hears where the loop is, for a watchdog: "update" and "dispatched"
    around `update` (with the step before it), "done" after `on_update` and "saving" before a
    save (with the step reached). Returns `(state, preempted)`."""
    mark = progress or (lambda phase, step: None)
    with _StopFlag(handle_sigterm) as flag:
        while int(state.step) < num_steps:
            before = int(state.step)
            mark("update", before)
            state, metrics = update(state)
            mark("dispatched", before)
            if on_update is not None:
                on_update(state, metrics)
            mark("done", int(state.step))
            if _agreed(flag.stop):
                mark("saving", int(state.step))
                save(state, True)
                return state, True
            if save_every and int(state.step) // save_every > before // save_every:
                mark("saving", int(state.step))
                save(state, False)
        mark("saving", int(state.step))
        save(state, True)
        # A SIGTERM after the last update's check (during its periodic save) or during the final
        # save: the stage is whole and saved, and the process stops here, not in the next stage.
        return state, _agreed(flag.stop)


@dataclasses.dataclass
class LoopResult:
    """What `train_loop` returns.

    Attributes:
        state: the final train state.
        history: the logged metrics, one dict per logged step.
        preempted: True when a SIGTERM or Ctrl-C stopped the loop after saving."""
    state: TrainState
    history: list[dict[str, float]]
    preempted: bool


def train_loop(trainer: Trainer, state: TrainState, batches: Iterable[Any], *, num_steps: int,
               checkpointer: Checkpointer | None = None, save_every: int | None = None,
               fingerprints: Mapping[str, Fingerprint] | None = None, config: Any = None,
               data_iterator: Any = None, calls_per_update: int = 1,
               on_step: Callable[[int, dict[str, float]], None] | None = None,
               handle_sigterm: bool = True) -> LoopResult:
    """Run update steps until `state.step == num_steps`, reading `calls_per_update` batches per
    update (streaming accumulation when > 1). Saves every `save_every` updates, at the end, and
    when SIGTERM or a first Ctrl-C arrives. `history` holds each call's metrics as floats."""
    if calls_per_update > 1 and state.accumulator is None:
        raise ValueError("train_loop: calls_per_update > 1 needs TrainerConfig(streaming=True)")
    if save_every is not None and checkpointer is None:
        raise ValueError("train_loop: save_every needs a checkpointer")
    iterator = iter(batches)
    history: list[dict[str, float]] = []

    def update(state: TrainState) -> tuple[TrainState, dict[str, float]]:
        for call in range(calls_per_update):
            try:
                batch = next(iterator)
            except StopIteration:
                raise ValueError(f"train_loop: the data ran out at step {int(state.step)} of {num_steps}; "
                                 "use a repeating dataset or lower num_steps") from None
            state, metrics = trainer.step(state, batch, is_update_step=call == calls_per_update - 1)
            history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        return state, history[-1]

    def save(state: TrainState, final: bool) -> None:
        if checkpointer is None:
            return
        if final:
            checkpointer.wait()  # an asynchronous save of this very step may still be in flight
        if int(state.step) not in checkpointer.all_steps():
            checkpointer.save(state, fingerprints=fingerprints, config=config, data_iterator=data_iterator,
                              force=final)
        if final:
            checkpointer.wait()

    on_update = None if on_step is None else (lambda state, metrics: on_step(int(state.step), metrics))
    state, preempted = run_updates(state, num_steps, update, save=save, on_update=on_update, save_every=save_every,
                                   handle_sigterm=handle_sigterm)
    return LoopResult(state, history, preempted)
