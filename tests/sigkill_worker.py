"""The whole stage chain (teacher and student SFT, OPD, GRPO) of the smoke preset in one process,
for `test_sigkill.py` to kill and rerun: `python sigkill_worker.py <case dir>`. It works in
`<case dir>` (checkpoints under `runs/pipeline/sigkill/checkpoints/<stage>/`) with one fixed run
id, so a rerun continues from whatever checkpoints the killed attempt left, as the flow's `resume`
does; a finished chain writes `<case dir>/done.json` (each stage's step and history). Every train
state a stage restores from its own checkpoints is noted in `<case dir>/restores.jsonl` (stage and
step), so a test can tell a continued stage from one that started over. With `--command`
(`python sigkill_worker.py <case dir> --command`) the chain runs through the user's command,
`python -m bd_train.stages run <preset>`, in this process; with the `BDLM_*` group variables (or a SLURM
job step's) set (`test_group.py`), the command joins that group as one of its processes, each with one CPU
device and the mesh's data axis over the group (its files then end in `-<id>`: `done-<id>.json`,
`restores-<id>.jsonl`).

The config is written relative to the case dir, so every case saves the same config in its
checkpoints' metadata. `JAX_COMPILATION_CACHE_DIR`, which the tests set, is the JAX cache of every
case (in place of each one's `runs/jax_cache`), so that reruns compile little.
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from pathlib import Path

SMOKE = Path(__file__).resolve().parents[1] / "flows" / "configs" / "smoke.toml"
RUN_ID = "sigkill"
STAGES = ("sft-teacher", "sft-student", "opd", "grpo")


def preset(processes: int = 1) -> dict:
    """The smoke preset, saving every 2 updates (several saves per stage: SFT 2, 4, 6; OPD 2, 3;
    GRPO 2, 4), with a cheap evaluation (4 problems, greedy only); for a group of `processes`,
    the data axis spans them. As TOML data (`toml` writes it)."""
    data = tomllib.loads(SMOKE.read_text())
    if processes > 1:
        data["mesh"] = {"data": processes, "num_nodes": processes}
    data["run"].update(output_dir="runs", checkpoint_every=2, max_to_keep=2)
    data["eval"].update(n=4, batch_size=4, samples_shown=2, samples=0, thresholds=[])
    return data


def config(processes: int = 1) -> dict:
    from bd_train.stages import parse_pipeline_config

    return parse_pipeline_config(preset(processes))


def toml(data: dict, prefix: str = "") -> str:
    """TOML text of preset data (scalars, lists and tables; JSON's literals are TOML's)."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in data.items() if not isinstance(value, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += ["", f"[{prefix}{key}]", toml(value, f"{prefix}{key}.")]
    return "\n".join(lines)


def checkpoint_dir(case: Path, stage: str) -> Path:
    return case / "runs" / "pipeline" / RUN_ID / "checkpoints" / stage


def _note_restores(case: Path, suffix: str = "") -> None:
    """Append `{"stage", "step"}` to `restores<suffix>.jsonl` after every `Checkpointer.restore`
    (the driver's resume; start models are read with `restore_model`, which is not noted)."""
    from bd_train import Checkpointer

    restore = Checkpointer.restore

    def noted(self: Checkpointer, target, **kwargs):
        state = restore(self, target, **kwargs)
        with open(case / f"restores{suffix}.jsonl", "a") as out:
            out.write(json.dumps({"stage": Path(self.directory).name, "step": int(state.step)}) + "\n")
        return state

    Checkpointer.restore = noted  # type: ignore[method-assign]


def command(case: Path, processes: int = 1, suffix: str = "") -> None:
    """The chain as a user runs (and reruns) it: `python -m bd_train.stages run <preset>`, with the
    preset written to `<case dir>/preset.toml` (the command finds the group of `processes` in the
    environment); `done<suffix>.json` from the checkpoints it leaves."""
    from bd_train import Checkpointer
    from bd_train.stages import parse_pipeline_config
    from bd_train.stages.cli import main as stages

    case.mkdir(parents=True, exist_ok=True)
    os.chdir(case)
    _note_restores(case, suffix)
    text = toml(preset(processes))
    assert parse_pipeline_config(text) == config(processes), "the preset's TOML does not read back as the preset"
    (case / f"preset{suffix}.toml").write_text(text)
    code = stages(["run", f"preset{suffix}.toml", "--run-id", RUN_ID])
    if code:
        sys.exit(code)
    summary = {}
    for stage in STAGES:
        with Checkpointer(checkpoint_dir(case, stage), create=False) as checkpoints:
            meta = checkpoints.read_meta()
        summary[stage] = {"step": meta["step"], "history": meta["history"]}
    (case / f"done{suffix}.json").write_text(json.dumps(summary))


def main(case: Path) -> None:
    from bd_train.stages import RunDir, check_distillation_pair, run_grpo, run_opd, run_sft

    case.mkdir(parents=True, exist_ok=True)
    os.chdir(case)
    _note_restores(case)
    cfg = config()
    where = RunDir.create(cfg, run_id=RUN_ID)
    teacher = run_sft(cfg, where, role="teacher")
    student = run_sft(cfg, where, role="student")
    check_distillation_pair(teacher, student)
    opd = run_opd(cfg, where, teacher=teacher, student=student)
    grpo = run_grpo(cfg, where, start=opd)
    results = dict(zip(STAGES, (teacher, student, opd, grpo)))
    summary = {name: {"step": r.step, "history": r.history} for name, r in results.items()}
    (case / "done.json").write_text(json.dumps(summary))


def _hold(spec: str, case: Path, index: int) -> None:
    """`BDLM_TEST_HOLD=<stage>:<step>:<process>`: that process holds at the start of the stage's
    update after `step` (its heartbeat goes on), writing `<case dir>/held-<process>` as it begins
    and going on once that file is removed; left in place, it hangs for good, for the progress
    watchdog to find. A test times a signal by the file, so the signal lands at that update on any
    host's load."""
    stage, step, process = spec.split(":")
    if int(process) != index:
        return
    from bd_train.distributed import Watchdog

    mark = Watchdog.mark

    def holding(self: Watchdog, phase: str, at: int) -> None:
        mark(self, phase, at)
        if (self.stage, phase, at) == (stage, "update", int(step)):
            held = case / f"held-{index}"
            held.touch()
            while held.exists():
                time.sleep(0.01)

    Watchdog.mark = holding  # type: ignore[method-assign]


if __name__ == "__main__":
    case = Path(sys.argv[1]).resolve()
    if sys.argv[2:] == ["--command"]:
        # the group's size and this process's place: bdlm's variables, or a SLURM job step's
        count = int(os.environ.get("BDLM_NUM_PROCESSES") or os.environ.get("SLURM_NTASKS", "1"))
        index = int(os.environ.get("BDLM_PROCESS_ID") or os.environ.get("SLURM_PROCID", "0"))
        if os.environ.get("BDLM_TEST_HOLD"):
            _hold(os.environ["BDLM_TEST_HOLD"], case, index)
        command(case, count, f"-{index}" if count > 1 else "")
    else:
        main(case)
