"""Asynchronous Orbax saves: the values at save, listed once committed, a failure raised at the
next wait, a kill mid-save leaving the previous step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import pytest

from bd_train import Checkpointer, CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import async_save_worker  # noqa: E402


def _host_copy(state) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves((state.step, state.model, state.opt_state))]


def _committed(folder, step: int) -> bool:
    return (folder / str(step)).is_dir()


def test_an_async_save_keeps_the_values_at_save_and_is_listed_once_committed(tmp_path):
    first, second = async_save_worker.state(1), async_save_worker.state(2)
    want = _host_copy(second)
    with Checkpointer(tmp_path, async_save=True) as checkpointer:
        checkpointer.save(first)
        checkpointer.save(second)  # waits for step 1, then returns while step 2 is written
        listed, committed = checkpointer.all_steps(), _committed(tmp_path, 2)
        assert listed == ([1, 2] if committed else [1]) and checkpointer.latest_step() == listed[-1]
        # training goes on: the saved arrays are donated to and overwritten by the next updates
        update = jax.jit(lambda tree: jax.tree.map(lambda x: x * 2 + 1 if eqx.is_inexact_array(x) else x, tree),
                         donate_argnums=0)
        arrays = (second.model, second.opt_state)
        del second
        for _ in range(3):
            arrays = update(arrays)
        jax.block_until_ready(arrays)
        checkpointer.wait()
        assert checkpointer.all_steps() == [1, 2]
        restored = checkpointer.restore(async_save_worker.state(0), step=2)  # checks every digest
    for got, saved in zip(_host_copy(restored), want, strict=True):
        assert got.dtype == saved.dtype and got.tobytes() == saved.tobytes()
    print(f"step 2 was {'committed' if committed else 'in flight'} when save returned")


def _damage_step_2_while_it_is_written(folder) -> bool:
    """Move step 2's temp folder away and put a file in its place, so that the rest of its writes
    and its rename fail; False when the background save won the race (committed, or made the
    folder again, before the damage landed: on a loaded host it can)."""
    temp = [p for p in folder.iterdir() if p.name.startswith("2.orbax-checkpoint-tmp")]
    if not temp:
        return False
    try:
        temp[0].rename(folder.parent / f"{folder.name}-moved")  # what was written so far goes away
        temp[0].write_text("not a folder")
    except OSError:
        return False
    return True


def test_a_failed_async_save_is_raised_at_the_next_wait_and_never_listed(tmp_path):
    for attempt in range(3):  # a fresh folder when the background save won the race to the damage
        folder = tmp_path / f"attempt{attempt}"
        with Checkpointer(folder, async_save=True) as checkpointer:
            checkpointer.save(async_save_worker.state(1))
            checkpointer.save(async_save_worker.state(2))
            if not _damage_step_2_while_it_is_written(folder):
                with contextlib.suppress(CheckpointError):  # a half-landed damage may still fail it
                    checkpointer.wait()
                continue
            with pytest.raises(CheckpointError, match="asynchronous save of step 2 failed in the background"):
                checkpointer.wait()
            assert checkpointer.all_steps() == [1]
            checkpointer.save(async_save_worker.state(3))  # saving goes on after the error was raised
        break
    else:
        pytest.fail("the background save of step 2 finished before the test could damage it, 3 times")
    with Checkpointer(folder, create=False) as checkpointer:
        assert checkpointer.all_steps() == [1, 3]
        checkpointer.restore(async_save_worker.state(0), step=3)


def test_a_kill_during_an_async_save_leaves_the_previous_step(tmp_path):
    folder = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "async_save_worker.py"), str(folder)],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not any(p.name.startswith("2.orbax-checkpoint-tmp") for p in folder.glob("2.*")):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the worker never started saving step 2"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _committed(folder, 2)
    with Checkpointer(folder, create=False) as checkpointer:
        assert checkpointer.all_steps() == [1] and checkpointer.latest_step() == 1
        restored = checkpointer.restore(async_save_worker.state(0))  # checks every digest
    for got, saved in zip(_host_copy(restored), _host_copy(async_save_worker.state(1)), strict=True):
        assert got.tobytes() == saved.tobytes()
