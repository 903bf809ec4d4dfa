"""A clean stop on SIGTERM and Ctrl-C: the loop saves the step it reached and says it stopped,
also when the signal comes after its last look at the flag; a second Ctrl-C interrupts at once."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import jax
import optax
import pytest

from bd_train import Checkpointer, Trainer, TrainerConfig, sft_objective, train_loop


def test_sigterm_saves_the_current_step_and_stops(tmp_path, toy_model, batch_factory):
    trainer = Trainer(sft_objective, optax.sgd(0.1), TrainerConfig())
    state = trainer.init(toy_model(key=jax.random.key(0)), key=jax.random.key(1))
    batches = (batch_factory(i) for i in range(100))

    def preempt(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path) as checkpointer:
        result = train_loop(trainer, state, batches, num_steps=50, checkpointer=checkpointer, on_step=preempt)
        assert result.preempted and int(result.state.step) == 3
        assert checkpointer.all_steps() == [3]
    assert signal.getsignal(signal.SIGTERM) == previous


@pytest.mark.parametrize("during", ["periodic", "final"])
def test_a_sigterm_after_the_last_updates_check_still_stops_the_process(during):
    """A SIGTERM during the last step's periodic save, or the final save, came after the loop's
    last look at the flag: it was swallowed, and the process went on into the next stage."""
    from bd_train._loop import run_updates

    saves = []

    def save(state, final):
        saves.append((state.step, final))
        if state.step == 4 and final == (during == "final"):
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    state, preempted = run_updates(SimpleNamespace(step=0), 4, lambda s: (SimpleNamespace(step=s.step + 1), {}),
                                   save=save, save_every=2)
    assert state.step == 4 and preempted and saves == [(2, False), (4, False), (4, True)]
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_first_ctrl_c_saves_and_stops_and_a_second_interrupts_at_once():
    """Ctrl-C (SIGINT) stops like a SIGTERM, at a saved step; a second one, during that save,
    raises KeyboardInterrupt at once rather than waiting (the handler before is back after the
    first)."""
    from bd_train._loop import run_updates

    saves = []

    def update(state):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return SimpleNamespace(step=state.step + 1), {}

    def save(state, final):
        saves.append((state.step, final))

    # Python's own handler before (a pytest-xdist worker ignores SIGINT), as in a terminal
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        state, preempted = run_updates(SimpleNamespace(step=0), 10, update, save=save)
        assert state.step == 3 and preempted and saves == [(3, True)]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def save_and_interrupt(state, final):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the first one's save runs

        with pytest.raises(KeyboardInterrupt):
            run_updates(SimpleNamespace(step=0), 10, update, save=save_and_interrupt)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # started ignoring it (a background job): it stays ignored
        state, preempted = run_updates(SimpleNamespace(step=0), 10, update, save=save)
        assert state.step == 10 and not preempted
    finally:
        signal.signal(signal.SIGINT, outer)
