"""The whole stage chain (teacher and student SFT, OPD, GRPO) of the smoke preset: run as one
process of a group on a (data 2, fsdp 2, model 2) mesh (`python stages_worker.py <coordinator>
<count> <id> <dir>`, each process with 8/count CPU devices), or unsharded, as one process on one
device (`python stages_worker.py single <dir>`), the reference the group is held to. Each writes the
stages' histories and evaluations to `<dir>/stages-<id>.json` (`stages-single.json`).

The tests run every chain in processes of its own: compiling the 8-device OPD step inside the
long-lived test process aborted twice late in a full run, and never in a fresh process."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

SMOKE = Path(__file__).resolve().parents[1] / "flows" / "configs" / "smoke.toml"
MESH = "data = 2\nfsdp = 2\nmodel = 2"


def config(mesh: str = MESH) -> dict:
    """The smoke preset with the student's SFT long enough (60 steps) that most completions are well
    formed: GRPO then sees rewards that differ within a group, so its updates carry signal, not float
    noise. The teacher only has to exist for OPD: 4 steps. Evaluation takes 2 samples for pass@k and
    one threshold for the NFE curve."""
    import tomllib

    from bd_train.stages import parse_pipeline_config

    data = tomllib.loads(SMOKE.read_text() + f"\n[mesh]\n{mesh}\n")
    data["sft"].update(steps=60, teacher_steps=4, optim={"lr": 1e-2, "warmup_steps": 2})
    data["eval"].update(samples=2, thresholds=[0.9])  # pass@k and the NFE curve on the mesh, at least cost
    return parse_pipeline_config(data)


def run_stages(directory: Path, mesh: str = MESH, run_id: str = "mesh") -> dict:
    """Every stage in `directory` on `mesh` (checkpoints and W&B under its runs/); returns the
    results."""
    from bd_train.stages import RunDir, run_grpo, run_opd, run_sft

    cwd = os.getcwd()
    os.chdir(directory)
    try:
        chain = config(mesh)
        where = RunDir.create(chain, run_id=run_id)
        teacher = run_sft(chain, where, role="teacher")
        student = run_sft(chain, where, role="student")
        opd = run_opd(chain, where, teacher=teacher, student=student)
        grpo = run_grpo(chain, where, start=opd)
    finally:
        os.chdir(cwd)
    return {"teacher": teacher, "student": student, "opd": opd, "grpo": grpo}


def summary(results: dict) -> dict:
    return {name: {"step": r.step, "history": r.history, "evaluation": r.evaluation.metrics(),
                   "curve": [[p.accuracy, p.mean_reward, p.nfe_per_token] for p in r.evaluation.accuracy_vs_nfe],
                   "decodings": [p.decoding for p in r.evaluation.accuracy_vs_nfe],
                   "samples": [dataclasses.asdict(s) for s in r.evaluation.samples], "seconds": r.seconds}
            for name, r in results.items()}


def run_single(out: Path) -> dict:
    """The chain in this process on one device, unsharded."""
    (out / "single").mkdir()
    return summary(run_stages(out / "single", mesh="data = 1", run_id="single"))


if __name__ == "__main__":
    import jax

    if sys.argv[1] == "single":
        out = Path(sys.argv[2])
        assert jax.device_count() == 1, "run without --xla_force_host_platform_device_count"
        (out / "stages-single.json").write_text(json.dumps(run_single(out)))
        sys.exit(0)

    from bd_train.distributed import ProcessGroup, initialize, shutdown

    coordinator, count, index, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    initialize(ProcessGroup(coordinator, count, index), cpu_devices=8 // count)
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // count
    results = run_stages(out)
    (out / f"stages-{index}.json").write_text(json.dumps(summary(results)))
    shutdown()
