"""The SFT stage as a Metaflow `@parallel` step on 2 local nodes, one JAX process group."""

from pathlib import Path

import jax
import numpy as np
from metaflow import Runner

from bd_train import Checkpointer
from bd_train.stages import Setup, parse_pipeline_config
from bd_train._stage_run import fresh_state

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(ROOT / "flows" / "bd_parallel.py")
PRESET = ROOT / "flows" / "configs" / "scale_multihost.toml"


def test_sft_runs_across_two_nodes(tmp_path):
    env = {"METAFLOW_USER": "tester", "WANDB_MODE": "offline", "BDLM_PROGRESS": "0", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": ""}
    with Runner(FLOW, show_output=False, cwd=str(tmp_path), env=env, config=[("config", str(PRESET))]).run(
            max_workers=2) as running:
        assert running.status == "successful", running.stdout[-3000:] + running.stderr[-3000:]
        run = running.run
    nodes = sorted(run["sft"], key=lambda task: task["node_index"].data)
    assert [task["node_index"].data for task in nodes] == [0, 1]
    assert all(task["devices"].data == (2, 2) for task in nodes)  # 2 processes, 1 device each
    histories = [[row["loss"] for row in task["result"].data.history] for task in nodes]
    assert histories[0] == histories[1]  # one global computation, reported by both nodes

    cfg = parse_pipeline_config(PRESET.read_text())
    result = run["end"].task["result"].data
    assert result.step == cfg["sft"]["steps"] and run["end"].task["nodes"].data == 2
    setup = Setup(cfg)
    _, target = fresh_state(setup.model_config("student"), setup.optimizer_config(setup.config.sft.optim, 4),
                            key=jax.random.key(0))
    with Checkpointer(result.checkpoint_dir, create=False) as checkpoints:
        restored = checkpoints.restore(target)
    assert int(restored.step) == cfg["sft"]["steps"]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored.params))
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored.params),
                                                         jax.tree.leaves(target.params)))
