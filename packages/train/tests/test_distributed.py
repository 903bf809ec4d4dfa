"""Two processes x 4 CPU devices train exactly like one process with 8, save one checkpoint
together, and that checkpoint restores into a single process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train.distributed import DistributedError, ProcessGroup, free_port

WORKER = Path(__file__).with_name("distributed_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_processes_equal_one_and_share_a_checkpoint(tmp_path, child_xla_flags):
    assert jax.device_count() == 8
    group_dir, single_dir = tmp_path / "group", tmp_path / "single"
    group_dir.mkdir()
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": child_xla_flags, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), coordinator, "2", str(i), str(group_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    worker = _worker_module()
    want_losses, want_state = worker.train(single_dir)  # the 8-device reference, while the group runs
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output[-3000:]

    for index in range(2):
        got = json.loads((group_dir / f"losses-{index}.json").read_text())
        np.testing.assert_allclose(got, want_losses, rtol=1e-5)

    from bd_train import Checkpointer

    with Checkpointer(group_dir / "checkpoints", create=False) as checkpoints:
        assert checkpoints.all_steps() == [worker.STEPS]
        restored = checkpoints.restore(want_state)
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(want_state.params)):
        assert got.sharding == want.sharding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(want_state.opt_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_process_group_from_the_environment():
    assert ProcessGroup.from_env({}) == ProcessGroup.single()
    env = {"BDLM_COORDINATOR_ADDRESS": "10.0.0.1:1234", "BDLM_NUM_PROCESSES": "4", "BDLM_PROCESS_ID": "3"}
    assert ProcessGroup.from_env(env) == ProcessGroup("10.0.0.1:1234", 4, 3)
    with pytest.raises(DistributedError, match=r"only \['BDLM_NUM_PROCESSES'\] are set"):
        ProcessGroup.from_env({"BDLM_NUM_PROCESSES": "2"})
    with pytest.raises(DistributedError, match="BDLM_PROCESS_ID: expected an integer, got 'one'"):
        ProcessGroup.from_env({**env, "BDLM_PROCESS_ID": "one"})
