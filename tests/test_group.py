"""A two-process group running the stage chain, three ways, against one uninterrupted run:

- the reference: the user's command on every process (`python -m bd_train.stages run <preset>`,
  as `sigkill_worker.py --command` runs it), the group found by JAX's own cluster detection (a
  simulated SLURM job step), the mesh's data axis over the group;
- the Metaflow flow with every training stage a `@parallel` step on 2 local nodes (each stage's
  nodes form one JAX process group), made to fail inside GRPO on both nodes after a checkpoint and
  finished by `resume` on 2 nodes again: every stage's checkpoint and metrics equal the
  reference's, bit for bit;
- the command again, its group from the `BDLM_*` variables, meeting what a cluster does to one of
  its processes, and rerun with the same command after each fault:
  - SIGKILL of process 0, which starts the group's coordination service, inside the teacher's SFT
    (held at the start of an update until the kill lands): process 1 stops within the group's
    `BDLM_LOST_AFTER_S` (plus a margin) with bdlm's message naming process 0, not JAX's abort;
  - process 1 hangs inside a teacher's SFT update while its heartbeat goes on: the progress
    watchdog ends both processes with exit 75, each leaving every thread's stack in the run folder
    and a line naming the stage, the step and process 1;
  - SIGTERM to one process only (a preempted VM) inside the student's SFT (held at the start of
    an update until the signal is sent): the whole group saves the same step and stops;
  - SIGKILL of process 1 while OPD writes a checkpoint, and again inside a GRPO update: process 0
    stops within the group's `BDLM_LOST_AFTER_S` (plus a margin) with a message that names process
    1 and says to `resume`; the rerun continues from the latest complete checkpoint (a half-written
    one is never restored).
  The chain must end with every checkpoint's arrays, both processes' data-iterator positions and
  metric histories bit-identical to the reference's.

One uninterrupted run serves every comparison (and fills the session's compilation cache for the
others). The preset is `sigkill_worker.preset(2)`: the smoke preset over a data axis of 2 processes
with one CPU device each, saving every 2 updates. The SFT faults are timed by a process holding at
an update (`sigkill_worker`'s `BDLM_TEST_HOLD`), the later kills by polling the checkpoint folders,
as in `test_sigkill.py`, whose helpers this reuses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train import Checkpointer
from bd_train.distributed import EXIT_LOST, free_port


def _helpers():
    """`test_sigkill.py`'s kill points, worker and restore targets (the suite imports test files by
    path, so it is loaded the same way)."""
    spec = importlib.util.spec_from_file_location("sigkill_helpers", Path(__file__).with_name("test_sigkill.py"))
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


_h = _helpers()
ATTEMPT_TIMEOUT, STAGES, WORKER, Kill, worker = _h.ATTEMPT_TIMEOUT, _h.STAGES, _h.WORKER, _h.Kill, _h.worker
_env, _inside_grpo, _opd_saving = _h._env, _h._inside_grpo, _h._opd_saving
_last_step, _listing, _saved = _h._last_step, _h._listing, _h._saved

PROCESSES = 2
LOST_AFTER = 5  # seconds of silence before the group gives a process up (default 60)
MARGIN = 30  # from the kill to the survivor's exit, beyond LOST_AFTER: a loaded 2-core host
SLURM_PORTS = range(65536 - 2**12, 65536)  # JAX's SLURM coordinator port: SLURM_JOB_ID % 4096 + 61440


# Where a process holds for a fault (`sigkill_worker`'s `BDLM_TEST_HOLD`, `<stage>:<step>:<process>`:
# at the start of the stage's update after that step). The SFT faults were once timed by the
# checkpoint listing; on a loaded host a kill seen at the teacher's step 2 landed after its last
# update, and the stall that follows then found no update ahead.
KILL_0 = "sft-teacher:3:0"  # process 0 is killed there (saves at 2, 4, 6)
STALL = "sft-teacher:5:1"  # process 1 hangs there for good
TERM = "sft-student:3:1"  # process 1 gets SIGTERM there, then goes on
STALL_FACTOR, STALL_FLOOR = 3, 10  # the watchdog's allowance in that attempt: max(3 x median, 10 s)


@dataclasses.dataclass(frozen=True)
class Fault:
    """`signal` to process `victim` once `kill.when(case)` holds; without a signal, the fault is
    the attempt's own (`env`), and `kill.when` only says when it began. With `release`, the test
    removes the victim's hold file (`BDLM_TEST_HOLD` in `env`) once the signal is sent, so that the
    victim goes on."""

    kill: Kill
    signal: signal.Signals | None
    victim: int | None = 1
    env: tuple[tuple[str, str], ...] = ()
    release: bool = False


def _holding(spec: str):
    """`when` of a fault that waits for `sigkill_worker`'s hold `spec` to begin: that process has
    written `held-<process>` and holds at the start of the update."""
    def when(case: Path) -> bool:
        return (case / f"held-{spec.split(':')[2]}").exists()
    return when


FAULTS = (
    Fault(Kill("sigkill-coordinator-inside-sft-teacher", _holding(KILL_0)), signal.SIGKILL, victim=0,
          env=(("BDLM_TEST_HOLD", KILL_0),)),
    Fault(Kill("stall-one-inside-sft-teacher", _holding(STALL)), None, victim=None,
          env=(("BDLM_TEST_HOLD", STALL), ("BDLM_STALL_FACTOR", str(STALL_FACTOR)),
               ("BDLM_STALL_FLOOR_S", str(STALL_FLOOR)))),
    Fault(Kill("sigterm-to-one-inside-sft", _holding(TERM)), signal.SIGTERM, env=(("BDLM_TEST_HOLD", TERM),),
          release=True),
    Fault(Kill("sigkill-one-during-opd-save", _opd_saving), signal.SIGKILL),
    Fault(Kill("sigkill-one-inside-grpo", _inside_grpo), signal.SIGKILL),
)
NAMES = [f.kill.name for f in FAULTS]


@dataclasses.dataclass
class Attempt:
    fault: str | None
    returncodes: list[int]
    survivor_seconds: float | None  # from the fault to the last exit of a process it did not hit
    restored: list[dict[str, int]]  # per process: the step each stage continued from
    logs: list[str]
    after_fault: dict[str, list[str]] | None = None


def _log(case: Path, index: int) -> Path:
    return case.parent / f"{case.name}-{index}.log"


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


def _group(index: int, *, slurm: bool, coordinator: str, job: int) -> dict[str, str]:
    """Process `index`'s group variables: bdlm's own, or a SLURM job step's for JAX to detect."""
    if slurm:
        return {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": str(PROCESSES),
                "SLURM_PROCID": str(index), "SLURM_LOCALID": str(index)}
    return {"BDLM_COORDINATOR_ADDRESS": coordinator, "BDLM_NUM_PROCESSES": str(PROCESSES),
            "BDLM_PROCESS_ID": str(index)}


def _attempt(case: Path, env: dict[str, str], fault: Fault | None = None, *, slurm: bool = False) -> Attempt:
    """The group on `case` (found from `BDLM_*` variables, or with `slurm` by JAX's SLURM
    detection); with `fault`, its signal to its victim once `fault.kill.when(case)` holds, then
    both processes are waited for (the others on their own)."""
    env = {**env, **dict(fault.env)} if fault is not None else env
    case.mkdir(parents=True, exist_ok=True)
    for held in case.glob("held-*"):  # a hang that the watchdog ended leaves its file
        held.unlink()
    seen = [len(p.read_text().splitlines()) if p.exists() else 0
            for p in (case / f"restores-{i}.jsonl" for i in range(PROCESSES))]
    offsets = [_log(case, i).stat().st_size if _log(case, i).exists() else 0 for i in range(PROCESSES)]
    coordinator, job = f"127.0.0.1:{free_port()}", _slurm_job_id() if slurm else 0
    env = {k: v for k, v in env.items() if not k.startswith(("BDLM_COORDINATOR_", "BDLM_NUM_", "BDLM_PROCESS_",
                                                             "SLURM_"))}
    begun = time.monotonic()
    logs = [open(_log(case, i), "a") for i in range(PROCESSES)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(case), "--command"],
                              env={**env, **_group(i, slurm=slurm, coordinator=coordinator, job=job)},
                              stdout=logs[i], stderr=subprocess.STDOUT, start_new_session=True)
             for i in range(PROCESSES)]
    faulted = survivor = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now - begun > ATTEMPT_TIMEOUT:
                pytest.fail(f"{case}: an attempt (fault: {fault and fault.kill.name}) ran over {ATTEMPT_TIMEOUT} s")
            victim = None if fault is None or fault.victim is None else procs[fault.victim]
            others = [p for p in procs if p is not victim]
            if fault is not None and faulted is None and (victim is None or victim.poll() is None) \
                    and fault.kill.when(case):
                if victim is not None and fault.signal is not None:
                    victim.send_signal(fault.signal)
                if fault.release:  # the hold's own process, which the fault's victim is
                    (case / f"held-{dict(fault.env)['BDLM_TEST_HOLD'].split(':')[2]}").unlink()
                faulted = now
            if faulted is not None and survivor is None and all(p.poll() is not None for p in others):
                survivor = now - faulted
            time.sleep(0.005)
        if faulted is not None and survivor is None:
            survivor = time.monotonic() - faulted
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    restored = []
    for i in range(PROCESSES):
        noted = case / f"restores-{i}.jsonl"
        lines = noted.read_text().splitlines()[seen[i]:] if noted.exists() else []
        restored.append({row["stage"]: row["step"] for row in map(json.loads, lines)})
    texts = [_log(case, i).read_text()[offsets[i]:] for i in range(PROCESSES)]
    return Attempt(fault and fault.kill.name, [p.returncode for p in procs], survivor, restored, texts,
                   _listing(case) if faulted is not None else None)


@pytest.fixture(scope="module")
def group_env(child_xla_flags) -> dict[str, str]:
    return {**_env(child_xla_flags), "BDLM_LOST_AFTER_S": str(LOST_AFTER)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, group_env) -> Path:
    """The group's chain without a fault, its group found by JAX's SLURM detection (it also fills
    the compilation cache)."""
    case = tmp_path_factory.mktemp("group") / "reference"
    attempt = _attempt(case, group_env, slurm=True)
    assert attempt.returncodes == [0] * PROCESSES, attempt.logs[0][-3000:] + attempt.logs[1][-3000:]
    for i, log in enumerate(attempt.logs):
        assert f"bdlm: process {i} of {PROCESSES} (JAX's slurm detection)" in log, log[-2000:]
    return case


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, reference, group_env) -> tuple[Path, list[Attempt]]:
    """The chain with every fault in turn, each followed by the next attempt, and a last one."""
    case = tmp_path_factory.mktemp("group") / "faulted"
    attempts = [_attempt(case, group_env, fault) for fault in FAULTS]
    attempts.append(_attempt(case, group_env))
    for a in attempts:
        print(f"{a.fault or 'to the end'}: returncodes {a.returncodes}, survivor {a.survivor_seconds}, "
              f"restored {a.restored}, after the fault {a.after_fault}")
    return case, attempts


def _left(attempt: Attempt) -> dict[str, int]:
    """The latest complete step of each stage once the fault had struck (a temp folder is no step)."""
    assert attempt.after_fault is not None
    return {stage: max(int(n) for n in names if n.isdigit()) for stage, names in attempt.after_fault.items()
            if any(n.isdigit() for n in names)}


def test_sigterm_to_one_process_stops_the_whole_group_at_one_saved_step(faulted):
    case, attempts = faulted
    index = NAMES.index("sigterm-to-one-inside-sft")
    attempt = attempts[index]
    assert attempt.after_fault is not None, "the SIGTERM was never sent"
    said = "stopped by SIGTERM or Ctrl-C at step "
    stopped = [[line for line in log.splitlines() if line.startswith(f"bdlm: sft-student: {said}")]
               for log in attempt.logs]
    assert all(stopped), f"a process did not stop on the SIGTERM: {attempt.returncodes}\n{attempt.logs[0][-3000:]}"
    steps = {line.split(said)[1].split(";")[0] for lines in stopped for line in lines}
    assert len(steps) == 1, f"the processes stopped at different steps: {steps}"
    assert attempt.returncodes == [1, 1]
    rerun = attempts[index + 1]
    assert rerun.restored[0]["sft-student"] == rerun.restored[1]["sft-student"] == int(steps.pop())


@pytest.mark.parametrize("name", [f.kill.name for f in FAULTS if f.signal == signal.SIGKILL])
def test_a_killed_process_ends_the_group_soon_with_what_to_do(faulted, name):
    case, attempts = faulted
    index = NAMES.index(name)
    fault, attempt, rerun = FAULTS[index], attempts[index], attempts[index + 1]
    assert attempt.after_fault is not None, f"{name}: the kill point was never seen"
    victim, survivor = fault.victim, 1 - fault.victim
    assert attempt.returncodes[victim] == -signal.SIGKILL, f"{name}: process {victim} ended before the kill landed"
    assert attempt.returncodes[survivor] == EXIT_LOST, attempt.logs[survivor][-3000:]
    assert attempt.survivor_seconds is not None and attempt.survivor_seconds <= LOST_AFTER + MARGIN
    # process 0 starts the coordination service: its death too ends the other with bdlm's line
    message = [line for line in attempt.logs[survivor].splitlines() if line.startswith(f"bdlm: process {victim} ")]
    assert len(message) == 1 and "is lost" in message[0] and "`resume`" in message[0], attempt.logs[survivor][-2000:]
    assert "JAX distributed service detected fatal errors" not in attempt.logs[survivor]
    # the rerun continues every stage from the latest complete step the kill left
    assert rerun.restored == [_left(attempt)] * PROCESSES, f"{name}: the rerun restored {rerun.restored}"


def test_a_stalled_process_ends_the_group_with_every_stack(faulted):
    case, attempts = faulted
    index = NAMES.index("stall-one-inside-sft-teacher")
    attempt, rerun = attempts[index], attempts[index + 1]
    assert attempt.after_fault is not None, "the stall never began"
    assert attempt.returncodes == [EXIT_LOST] * PROCESSES, attempt.logs[0][-3000:] + attempt.logs[1][-3000:]
    stage, step, slow = STALL.split(":")
    for i, log in enumerate(attempt.logs):
        lines = [line for line in log.splitlines() if line.startswith(f"bdlm: {stage} made no progress for ")]
        assert len(lines) == 1, log[-3000:]
        assert f" at step {step} " in lines[0] and f"the slowest: process {slow} " in lines[0], lines[0]
        assert "`resume`" in lines[0]
        allowed = float(lines[0].split("the median update ")[1].split(" s")[0]) * STALL_FACTOR
        assert attempt.survivor_seconds is not None
        assert attempt.survivor_seconds <= max(allowed, STALL_FLOOR) + MARGIN
        stacks = case / "runs" / "pipeline" / _h.worker.RUN_ID / "stacks" / f"{stage}-process{i}.txt"
        assert str(stacks) in lines[0] and stacks.is_file()
        text = stacks.read_text()
        assert "most recent call first" in text, text[:2000]
        if i == int(slow):  # the stalled process's stack shows where it hangs (the others may have moved on)
            assert "run_updates" in text, text[:2000]
    assert rerun.restored == [_left(attempt)] * PROCESSES, f"the rerun restored {rerun.restored}"


@pytest.mark.parametrize("stage", STAGES)
def test_the_resumed_group_ends_bit_identical_to_the_uninterrupted_one(reference, faulted, stage):
    case, attempts = faulted
    assert attempts[-1].returncodes == [0] * PROCESSES, attempts[-1].logs[0][-3000:]
    want, got = _saved(reference, stage, PROCESSES), _saved(case, stage, PROCESSES)
    # both keep the last step; the SIGTERM's own save (at whatever step it landed) may be kept too
    assert max(got) == max(want) == _last_step(stage), f"{stage}: kept steps {list(got)} vs {list(want)}"
    for step in sorted(set(want) & set(got)):
        assert got[step]["meta"] == want[step]["meta"], f"{stage} step {step}: metadata differs"
        assert got[step]["data"] == want[step]["data"], f"{stage} step {step}: a data-iterator state differs"
        assert got[step]["arrays"].keys() == want[step]["arrays"].keys()
        for path, array in want[step]["arrays"].items():
            assert got[step]["arrays"][path].tobytes() == array.tobytes(), f"{stage} step {step}: {path} differs"


def test_the_resumed_group_reports_the_uninterrupted_histories(reference, faulted):
    case, attempts = faulted
    assert attempts[-1].returncodes == [0] * PROCESSES
    for i in range(PROCESSES):
        want, got = (json.loads((c / f"done-{i}.json").read_text()) for c in (reference, case))
        assert got == want


# -- the flow on two nodes ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, flow_runs, reference):
    """The flow on the reference's preset, failing after GRPO's update 2 and resumed; after the
    reference, so that it compiles nothing the reference compiled. W&B is off, as in the reference
    (tests/test_pipeline.py reads the flow's W&B logs)."""
    cwd = tmp_path_factory.mktemp("parallel")
    preset = cwd / "preset.toml"
    preset.write_text(worker.toml(worker.preset(PROCESSES)))
    run, _ = flow_runs.crash_and_resume(preset, cwd, fault="grpo:2", WANDB_MODE="disabled")  # as the reference
    return cwd, run


def test_every_stage_runs_across_two_nodes_and_resumes(flow_run):
    _, run = flow_run
    assert run["sft"].task.origin_pathspec is not None and run["opd"].task.origin_pathspec is not None  # cloned
    for name, artifact, stage in [("sft", "result", None), ("opd", "opd_result", "opd"),
                                  ("grpo", "grpo_result", "grpo")]:
        tasks = list(run[name])
        indices = sorted(task["node_index"].data for task in tasks)
        assert indices == ([0, 0, 1, 1] if name == "sft" else [0, 1]), (name, indices)  # sft: a group per role
        for role_tasks in _by_group(tasks, name):
            results = [task[artifact].data for task in sorted(role_tasks, key=lambda t: t["node_index"].data)]
            assert results[0].step == _last_step(stage or f"sft-{results[0].role}")
            if name == "grpo":  # continued from the checkpoint of update 2 (its curve kept), on both nodes
                last, every = _last_step("grpo"), worker.config()["grpo"]["updates_per_rollout"]
                assert [r["step"] for r in results[0].history] == list(range(every, last + 1, every))
                kept = sorted(int(p.name) for p in Path(results[0].checkpoint_dir).iterdir() if p.name.isdigit())
                assert kept == [last - 2, last], kept  # saved every 2 updates, the last 2 kept
            # one global computation: both nodes report the same losses and held-out numbers
            assert [r["loss"] for r in results[0].history] == [r["loss"] for r in results[1].history]
            assert results[0].evaluation.metrics() == results[1].evaluation.metrics()
    assert list(run["end"].task["summary"].data) == ["teacher_sft", "student_sft", "student_opd", "student_grpo"]


def _by_group(tasks, name):
    if name != "sft":
        return [tasks]
    groups = {}
    for task in tasks:
        groups.setdefault(task["role"].data, []).append(task)
    assert sorted(groups) == ["student", "teacher"]
    return list(groups.values())


def _role(step, role: str):
    return next(task["result"].data for task in step if task["role"].data == role)


def test_the_flow_ends_equal_to_the_command_on_every_host(flow_run, reference):
    """Every stage's last checkpoint (arrays, metadata history) and result history: the flow's, on
    2 nodes after its crash and resume, and the reference's, through the command on 2 processes."""
    _, run = flow_run
    flow = {"sft-teacher": _role(run["sft"], "teacher"), "sft-student": _role(run["sft"], "student"),
            "opd": run["opd"].task["opd_result"].data, "grpo": run["grpo"].task["grpo_result"].data}
    done = json.loads((reference / "done-0.json").read_text())
    for stage, result in flow.items():
        assert result.history == done[stage]["history"], stage
        target = _h._target(stage)
        with Checkpointer(result.checkpoint_dir, create=False) as got, \
                Checkpointer(worker.checkpoint_dir(reference, stage), create=False) as want:
            assert got.latest_step() == want.latest_step() == result.step == _last_step(stage), stage
            assert got.read_meta()["history"] == want.read_meta()["history"], stage
            a, b = (c.restore(target) for c in (want, got))
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
            if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f"{stage}: {jax.tree_util.keystr(path)}"
