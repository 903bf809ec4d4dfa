"""The training loop: steps, periodic checkpoints and a clean stop on SIGTERM.

A SIGTERM (preemption) only sets a flag; the loop finishes the current update, saves it and
returns with `preempted=True`, so the process exits normally and `resume` continues from there.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from bd_core import Fingerprint

from ._checkpoint import Checkpointer
from ._trainer import Trainer, TrainState


class _StopFlag:
    """Records SIGTERM while installed (main thread only; elsewhere signals cannot be caught)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.stop = False
        self._previous: Any = None

    def _handle(self, signum, frame):
        self.stop = True

    def __enter__(self) -> _StopFlag:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class LoopResult:
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
    when SIGTERM arrives. `history` holds each call's metrics as floats."""
    if calls_per_update > 1 and state.accumulator is None:
        raise ValueError("train_loop: calls_per_update > 1 needs TrainerConfig(streaming=True)")
    if save_every is not None and checkpointer is None:
        raise ValueError("train_loop: save_every needs a checkpointer")
    iterator = iter(batches)
    history: list[dict[str, float]] = []

    def save(force: bool) -> None:
        if checkpointer is not None and int(state.step) not in checkpointer.all_steps():
            checkpointer.save(state, fingerprints=fingerprints, config=config, data_iterator=data_iterator,
                              force=force)

    preempted = False
    with _StopFlag(handle_sigterm) as flag:
        while int(state.step) < num_steps:
            for call in range(calls_per_update):
                try:
                    batch = next(iterator)
                except StopIteration:
                    raise ValueError(f"train_loop: the data ran out at step {int(state.step)} of {num_steps}; "
                                     "use a repeating dataset or lower num_steps") from None
                state, metrics = trainer.step(state, batch, is_update_step=call == calls_per_update - 1)
                history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
            step = int(state.step)
            if on_step is not None:
                on_step(step, history[-1])
            if flag.stop:
                preempted = True
                break
            if save_every is not None and step % save_every == 0:
                save(force=False)
        save(force=True)
        if checkpointer is not None:
            checkpointer.wait()
    return LoopResult(state, history, preempted)
