"""The whole pipeline with every training stage as a Metaflow `@parallel` step on 2 local nodes:
each stage's nodes form one JAX process group over a 2-device mesh. The run fails inside GRPO
on both nodes (after a checkpoint), and `resume` finishes it on 2 nodes again."""

from pathlib import Path

import jax
import numpy as np

from bd_train import Checkpointer, make_optimizer
from bd_train.stages import Run, parse_pipeline_config

PRESET = Path(__file__).resolve().parents[1] / "flows" / "configs" / "scale_multihost.toml"


def test_every_stage_runs_across_two_nodes_and_resumes(tmp_path, flow_runs):
    run, _ = flow_runs.crash_and_resume(PRESET, tmp_path, fault="grpo:2")
    assert run["sft"].task.origin_pathspec is not None and run["opd"].task.origin_pathspec is not None  # cloned
    cfg = parse_pipeline_config(PRESET.read_text())
    for name, artifact, steps in [("sft", "result", cfg["sft"]["steps"]), ("opd", "opd_result", cfg["opd"]["steps"]),
                                  ("grpo", "grpo_result", cfg["grpo"]["steps"] * cfg["grpo"]["updates_per_rollout"])]:
        tasks = list(run[name])
        indices = sorted(task["node_index"].data for task in tasks)
        assert indices == ([0, 0, 1, 1] if name == "sft" else [0, 1]), (name, indices)  # sft: a group per role
        for role_tasks in _by_group(tasks, name):
            results = [task[artifact].data for task in sorted(role_tasks, key=lambda t: t["node_index"].data)]
            assert results[0].step == steps
            if name == "grpo":  # continued from the checkpoint of update 2 (its curve kept), on both nodes
                assert [r["step"] for r in results[0].history] == [2, 4]
            # one global computation: both nodes report the same losses and held-out numbers
            assert [r["loss"] for r in results[0].history] == [r["loss"] for r in results[1].history]
            assert results[0].evaluation.metrics() == results[1].evaluation.metrics()

    summary = run["end"].task["summary"].data
    assert list(summary) == ["teacher_sft", "student_sft", "student_opd", "student_grpo"]
    grpo = run["grpo_nodes"].task["grpo_result"].data
    setup = Run(cfg)
    optimizer = make_optimizer(setup.optimizer_config(setup.config.grpo.optim, 4))
    target = setup.fresh_state(setup.model_config("student"), optimizer, key=jax.random.key(0))
    with Checkpointer(grpo.checkpoint_dir, create=False) as checkpoints:  # saved by both nodes, restored by one
        restored = checkpoints.restore(target)
    assert int(restored.step) == grpo.step
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored.params))


def _by_group(tasks, name):
    if name != "sft":
        return [tasks]
    groups = {}
    for task in tasks:
        groups.setdefault(task["role"].data, []).append(task)
    assert sorted(groups) == ["student", "teacher"]
    return list(groups.values())
