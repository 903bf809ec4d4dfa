"""A two-process group running the stage chain through the user's command (`python -m
bd_train.stages run <preset>` on each process, the group from the `BDLM_*` variables, as
`sigkill_worker.py --command` runs it; the mesh's data axis over the group) meets what a cluster
does to one of its processes, and resumes with the same command:

- SIGKILL of process 0, which starts the group's coordination service, inside the teacher's SFT:
  process 1 stops within the group's `BDLM_LOST_AFTER_S` (plus a margin) with bdlm's message
  naming process 0, not JAX's abort;
- process 1 hangs inside a teacher's SFT update while its heartbeat goes on: the progress
  watchdog ends both processes with exit 75, each leaving every thread's stack in the run folder
  and a line naming the stage, the step and process 1;
- SIGTERM to one process only (a preempted VM) inside the student's SFT: the whole group saves the
  same step and stops;
- SIGKILL of process 1 while OPD writes a checkpoint, and again inside a GRPO update: process 0
  stops within the group's `BDLM_LOST_AFTER_S` (plus a margin) with a message that names process
  1 and says to `resume`; the rerun continues from the latest complete checkpoint (a half-written
  one is never restored).

After each, the group is started again, as the flow's `resume` does; the chain must end with every
checkpoint's arrays, both processes' data-iterator positions and metric histories bit-identical to
an uninterrupted group's run. The kills are timed by polling the checkpoint folders, as in
`test_sigkill.py`, whose helpers this reuses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
_env, _inside_grpo, _inside_sft, _opd_saving = _h._env, _h._inside_grpo, _h._inside_sft, _h._opd_saving
_last_step, _listing, _saved = _h._last_step, _h._listing, _h._saved

PROCESSES = 2
LOST_AFTER = 5  # seconds of silence before the group gives a process up (default 60)
MARGIN = 30  # from the kill to the survivor's exit, beyond LOST_AFTER: a loaded 2-core host


STALL = "sft-teacher:5:1"  # process 1 hangs in the teacher's update after step 5 (saves at 2, 4, 6)
STALL_FACTOR, STALL_FLOOR = 3, 10  # the watchdog's allowance in that attempt: max(3 x median, 10 s)


@dataclasses.dataclass(frozen=True)
class Fault:
    """`signal` to process `victim` once `kill.when(case)` holds; without a signal, the fault is
    the attempt's own (`env`), and `kill.when` only says when it began."""

    kill: Kill
    signal: signal.Signals | None
    victim: int | None = 1
    env: tuple[tuple[str, str], ...] = ()


def _inside_sft_teacher(case: Path) -> bool:  # a periodic save of the teacher's SFT, not its last
    steps = _h._steps(case, "sft-teacher")
    return bool(steps) and steps[-1] < _last_step("sft-teacher")


def _stalled(case: Path) -> bool:
    return (case / f"stalled-{STALL.split(':')[2]}").exists()


FAULTS = (
    Fault(Kill("sigkill-coordinator-inside-sft-teacher", _inside_sft_teacher), signal.SIGKILL, victim=0),
    Fault(Kill("stall-one-inside-sft-teacher", _stalled), None, victim=None,
          env=(("BDLM_TEST_STALL", STALL), ("BDLM_STALL_FACTOR", str(STALL_FACTOR)),
               ("BDLM_STALL_FLOOR_S", str(STALL_FLOOR)))),
    Fault(Kill("sigterm-to-one-inside-sft", _inside_sft), signal.SIGTERM),
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


def _attempt(case: Path, env: dict[str, str], fault: Fault | None = None) -> Attempt:
    """The group on `case`; with `fault`, its signal to its victim once `fault.kill.when(case)`
    holds, then both processes are waited for (the others on their own)."""
    env = {**env, **dict(fault.env)} if fault is not None else env
    case.mkdir(parents=True, exist_ok=True)
    seen = [len(p.read_text().splitlines()) if p.exists() else 0
            for p in (case / f"restores-{i}.jsonl" for i in range(PROCESSES))]
    offsets = [_log(case, i).stat().st_size if _log(case, i).exists() else 0 for i in range(PROCESSES)]
    coordinator = f"127.0.0.1:{free_port()}"
    begun = time.monotonic()
    logs = [open(_log(case, i), "a") for i in range(PROCESSES)]
    group = {"BDLM_COORDINATOR_ADDRESS": coordinator, "BDLM_NUM_PROCESSES": str(PROCESSES)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(case), "--command"],
                              env={**env, **group, "BDLM_PROCESS_ID": str(i)},
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
    """The group's chain without a fault (it also fills the compilation cache)."""
    case = tmp_path_factory.mktemp("group") / "reference"
    attempt = _attempt(case, group_env)
    assert attempt.returncodes == [0] * PROCESSES, attempt.logs[0][-3000:] + attempt.logs[1][-3000:]
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
    stopped = [[line for line in log.splitlines() if line.startswith("bdlm: sft-student: stopped by SIGTERM at step ")]
               for log in attempt.logs]
    assert all(stopped), f"a process did not stop on the SIGTERM: {attempt.returncodes}\n{attempt.logs[0][-3000:]}"
    steps = {line.split("stopped by SIGTERM at step ")[1].split(";")[0] for lines in stopped for line in lines}
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
