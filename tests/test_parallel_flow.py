"""The whole pipeline with every training stage as a Metaflow `@parallel` step on 2 local nodes:
each stage's nodes form one JAX process group over a 2-device mesh. The run fails inside GRPO
on both nodes (after a checkpoint), and `resume` finishes it on 2 nodes again. Then the same
preset runs through the command a user starts on every host, `python -m bd_train.stages run`, on
2 local processes whose group JAX's own cluster detection finds (a simulated SLURM job step): it
ends with every stage's checkpoint and metrics equal to the flow's, bit for bit."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train import Checkpointer, make_optimizer
from bd_train.stages import Run, parse_pipeline_config

PRESET = Path(__file__).resolve().parents[1] / "flows" / "configs" / "scale_multihost.toml"
SLURM_PORTS = range(65536 - 2**12, 65536)  # JAX's SLURM coordinator port: SLURM_JOB_ID % 4096 + 61440


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, flow_runs):
    cwd = tmp_path_factory.mktemp("parallel")
    run, _ = flow_runs.crash_and_resume(PRESET, cwd, fault="grpo:2")
    return cwd, run


def test_every_stage_runs_across_two_nodes_and_resumes(flow_run):
    _, run = flow_run
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


def _slurm_job_id() -> int:
    """A job id whose coordinator port (as JAX's SLURM detection derives it) is free on this host."""
    for port in np.random.default_rng(os.getpid()).permutation(SLURM_PORTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", int(port)))
            except OSError:
                continue
        return 10_000 * 4096 + int(port) - SLURM_PORTS.start
    raise RuntimeError("no free port for the simulated SLURM coordinator")


def test_the_command_on_every_host_ends_equal_to_the_flow(flow_run, flow_runs):
    cwd, run = flow_run
    job = {"SLURM_JOB_ID": str(_slurm_job_id()), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BDLM_", "SLURM_"))}
    procs = [subprocess.Popen([sys.executable, "-m", "bd_train.stages", "run", str(PRESET), "--run-id", "by-command"],
                              cwd=cwd, env={**env, **flow_runs.env(), **job, "SLURM_PROCID": str(i),
                                            "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output[-4000:]
        assert f"bdlm: process {i} of 2 (JAX's slurm detection)" in output, output[-2000:]

    cfg = parse_pipeline_config(PRESET.read_text())
    setup = Run(cfg)
    flow = {"sft-teacher": _role(run["sft"], "teacher"), "sft-student": _role(run["sft"], "student"),
            "opd": run["opd"].task["opd_result"].data, "grpo": run["grpo"].task["grpo_result"].data}
    for stage, result in flow.items():
        sft = stage.startswith("sft-")
        role = stage.removeprefix("sft-") if sft else "student"
        steps = setup.config.sft.steps_for(role) if sft else result.step
        optimizer = make_optimizer(setup.optimizer_config(getattr(setup.config, "sft" if sft else stage).optim, steps))
        target = setup.fresh_state(setup.model_config(role), optimizer, key=jax.random.key(0))
        mine = cwd / "runs" / "pipeline" / "by-command" / "checkpoints" / stage
        with Checkpointer(result.checkpoint_dir, create=False) as want, Checkpointer(mine, create=False) as got:
            assert got.latest_step() == want.latest_step() == result.step, stage
            assert got.read_meta()["history"] == want.read_meta()["history"] == result.history, stage
            a, b = (c.restore(target) for c in (want, got))
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
            if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f"{stage}: {jax.tree_util.keystr(path)}"


def _role(step, role: str):
    return next(task["result"].data for task in step if task["role"].data == role)
