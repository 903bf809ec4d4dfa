"""SIGKILL at points of the stage chain (inside SFT, between OPD and GRPO), each followed by a rerun
that continues from the checkpoints, as the flow's `resume` does: the chain must end with
checkpoints bit-identical to an uninterrupted run's. (`test_group.py` kills one process of
a group during an OPD checkpoint save and inside GRPO, with the same checks after its rerun.)

The kills land one after another in one run folder (each rerun is the next kill's victim): one
chain of three attempts costs less than two separate cases, and a stage's final checkpoints are
written by the attempt that finished it, so each kill is still judged by the stages it hit. A
kill is timed by polling the checkpoint folders, so where it lands varies; the property must hold
wherever that is, but every kill must land before the attempt ends (`returncode == -SIGKILL`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from bd_train import Checkpointer, make_optimizer
from bd_train.stages import Run

WORKER = Path(__file__).with_name("sigkill_worker.py")
TMP = ".orbax-checkpoint-tmp"  # Orbax writes `<step>.orbax-checkpoint-tmp`, renamed to `<step>` once complete
ATTEMPT_TIMEOUT = 900


def _worker():
    spec = importlib.util.spec_from_file_location("sigkill_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _worker()
STAGES = worker.STAGES


def _entries(case: Path, stage: str) -> list[str]:
    folder = worker.checkpoint_dir(case, stage)
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _steps(case: Path, stage: str) -> list[int]:
    return sorted(int(name) for name in _entries(case, stage) if name.isdigit())


def _listing(case: Path) -> dict[str, list[str]]:
    return {stage: _entries(case, stage) for stage in STAGES if worker.checkpoint_dir(case, stage).is_dir()}


@functools.cache
def _last_step(stage: str) -> int:
    cfg = Run(worker.config()).config
    return {"sft-teacher": cfg.sft.steps_for("teacher"), "sft-student": cfg.sft.steps_for("student"),
            "opd": cfg.opd.steps, "grpo": cfg.grpo.steps * cfg.grpo.updates_per_rollout}[stage]


@dataclasses.dataclass(frozen=True)
class Kill:
    """A kill point: `when(case)` is polled while the attempt runs; SIGKILL as soon as it holds."""

    name: str
    when: Callable[[Path], bool]


def _inside_sft(case: Path) -> bool:  # a periodic save of the student's SFT, not its last
    steps = _steps(case, "sft-student")
    return bool(steps) and steps[-1] < _last_step("sft-student")


def _opd_saving(case: Path) -> bool:  # Orbax is writing an OPD checkpoint
    return any(TMP in name for name in _entries(case, "opd"))


def _between_opd_and_grpo(case: Path) -> bool:  # OPD is done, GRPO has begun and saved nothing
    return (_last_step("opd") in _steps(case, "opd") and worker.checkpoint_dir(case, "grpo").is_dir()
            and not _entries(case, "grpo"))


def _inside_grpo(case: Path) -> bool:  # after GRPO's first save, before its last
    steps = _steps(case, "grpo")
    return bool(steps) and steps[-1] < _last_step("grpo")


# The kill points of one process; `test_group.py` kills one process of a group during an
# OPD save and inside GRPO (`_opd_saving`, `_inside_grpo`), followed by the same resume checks.
KILLS = (
    Kill("inside-sft-student", _inside_sft),
    Kill("between-opd-and-grpo", _between_opd_and_grpo),
)


@dataclasses.dataclass
class Attempt:
    kill: str | None
    returncode: int
    seconds: float
    restored: dict[str, int]  # the step each stage continued from (`restores.jsonl`)
    at_kill: dict[str, list[str]] | None = None  # the checkpoint folders when the kill was sent
    after_kill: dict[str, list[str]] | None = None  # and once the process was gone


def _env(xla_flags: str) -> dict[str, str]:
    """The worker's environment; the session's compilation cache (root conftest.py) comes with it."""
    return {**os.environ, "WANDB_MODE": "disabled", "BDLM_PROGRESS": "0", "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": xla_flags,
            # `eqx.error_if` (in the sampler's cached forward) is a host callback under the default
            # "raise", and JAX never writes programs with host callbacks to its persistent cache: every
            # attempt would compile the samplers anew (about half of a warm attempt's time). "nan" keeps
            # the check's program callback-free; it never fires here, so no value changes.
            "EQX_ON_ERROR": "nan"}


def _attempt(case: Path, env: dict[str, str], kill: Kill | None = None, *, command: bool = False) -> Attempt:
    """One run of the worker on `case`; with `kill`, SIGKILL to its process group once
    `kill.when(case)` holds; with `command`, the chain runs through `python -m bd_train.stages run`."""
    noted = case / "restores.jsonl"
    seen = len(noted.read_text().splitlines()) if noted.exists() else 0
    begun = time.monotonic()
    with open(case.parent / f"{case.name}.log", "a") as log:
        log.write(f"\n=== attempt (kill: {kill.name if kill else None}) ===\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, str(WORKER), str(case), *(["--command"] if command else [])],
                                env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        at_kill = None
        try:
            while proc.poll() is None:
                if time.monotonic() - begun > ATTEMPT_TIMEOUT:
                    pytest.fail(f"{case}: an attempt (kill: {kill and kill.name}) ran over {ATTEMPT_TIMEOUT} s")
                if kill is not None and kill.when(case):
                    at_kill = _listing(case)
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended just now: its returncode says so
                        pass
                    proc.wait()
                    break
                time.sleep(0.005)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - begun
    lines = noted.read_text().splitlines()[seen:] if noted.exists() else []
    restored = {row["stage"]: row["step"] for row in map(json.loads, lines)}
    return Attempt(kill.name if kill else None, proc.returncode, seconds, restored, at_kill,
                   _listing(case) if at_kill is not None else None)


def _log_tail(case: Path) -> str:
    return (case.parent / f"{case.name}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, child_xla_flags) -> Path:
    """The chain run once without a kill (it also fills the compilation cache)."""
    case = tmp_path_factory.mktemp("sigkill") / "reference"
    attempt = _attempt(case, _env(child_xla_flags))
    assert attempt.returncode == 0, _log_tail(case)
    assert attempt.restored == {}, attempt.restored
    print(f"\nreference: {attempt.seconds:.0f} s")
    return case


@pytest.fixture(scope="module")
def killed(tmp_path_factory, reference, child_xla_flags) -> tuple[Path, list[Attempt]]:
    """The chain killed at every kill point in turn, then run to the end: one attempt per kill
    point (in `KILLS` order), and the last. These attempts run the chain as a user does, through
    `python -m bd_train.stages run <preset>` (the reference calls the stage functions itself), so
    the command, rerun after each kill, must end bit-identical to the uninterrupted chain."""
    case = tmp_path_factory.mktemp("sigkill") / "killed"
    env = _env(child_xla_flags)
    attempts = [_attempt(case, env, kill, command=True) for kill in KILLS]
    attempts.append(_attempt(case, env, command=True))
    for attempt in attempts:
        print(f"{attempt.kill or 'to the end'}: rc {attempt.returncode}, {attempt.seconds:.0f} s; restored "
              f"{attempt.restored}; at the kill {attempt.at_kill}; after it {attempt.after_kill}")
    return case, attempts


@pytest.mark.parametrize("index", range(len(KILLS)), ids=[kill.name for kill in KILLS])
def test_each_kill_lands_and_the_rerun_continues_from_what_it_left(killed, index):
    case, attempts = killed
    attempt, rerun = attempts[index], attempts[index + 1]
    assert attempt.returncode == -signal.SIGKILL, (
        f"{attempt.kill}: the attempt was not killed (returncode {attempt.returncode}): "
        + ("it ended before the kill point was seen" if attempt.at_kill is None else "it ended before SIGKILL landed")
        + f"; its checkpoints: {_listing(case)}\n{_log_tail(case)}")
    assert attempt.after_kill is not None
    assert rerun.returncode in (0, -signal.SIGKILL), f"the rerun after {attempt.kill} failed:\n{_log_tail(case)}"
    # every stage continues from the latest complete step the kill left (a temp folder is no step),
    # and a stage that had saved none starts over
    left = {stage: max(int(n) for n in names if n.isdigit()) for stage, names in attempt.after_kill.items()
            if any(n.isdigit() for n in names)}
    assert rerun.restored == left, f"{attempt.kill}: the rerun restored {rerun.restored}, the kill left {left}"


@functools.cache
def _target(stage: str):
    """A fresh train state of the stage's model and optimizer: the structure to restore into."""
    run = Run(worker.config())
    cfg = run.config
    if stage.startswith("sft-"):
        role, section, steps = stage.removeprefix("sft-"), cfg.sft.optim, cfg.sft.steps_for(stage.removeprefix("sft-"))
    else:
        role, section, steps = "student", getattr(cfg, stage).optim, _last_step(stage)
    optimizer = make_optimizer(run.optimizer_config(section, steps))
    return run.fresh_state(run.model_config(role), optimizer, key=jax.random.key(0))


def _saved(case: Path, stage: str, processes: int = 1) -> dict:
    """Every kept step of a stage: its metadata, the data-iterator state of each of the
    `processes` that wrote it and every array (restored into this one process, and so checked
    against the digests recorded at save)."""
    folder = worker.checkpoint_dir(case, stage)
    out = {}
    with Checkpointer(folder, create=False) as checkpoints:
        for step in checkpoints.all_steps():
            state = checkpoints.restore(_target(stage), step=step)
            arrays = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
                      jax.tree_util.tree_leaves_with_path((state.step, state.model, state.opt_state,
                                                           jax.random.key_data(state.key), state.nonfinite_total,
                                                           state.nonfinite_streak)) if hasattr(leaf, "dtype")}
            out[step] = {"meta": checkpoints.read_meta(step), "arrays": arrays,
                         "data": [json.loads((folder / str(step) / "data" / f"process_{i}-of-{processes}.json")
                                             .read_text()) for i in range(processes)]}
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_ends_bit_identical_to_the_uninterrupted_run(reference, killed, stage):
    case, attempts = killed
    assert attempts[-1].returncode == 0, f"the rerun after the last kill failed:\n{_log_tail(case)}"
    want, got = _saved(reference, stage), _saved(case, stage)
    assert list(got) == list(want) and max(got) == _last_step(stage), f"{stage}: kept steps {list(got)} vs {list(want)}"
    for step in want:
        for key in want[step]["meta"]:
            assert got[step]["meta"][key] == want[step]["meta"][key], f"{stage} step {step}: metadata {key!r} differs"
        assert got[step]["meta"].keys() == want[step]["meta"].keys()
        assert got[step]["data"] == want[step]["data"], f"{stage} step {step}: the data-iterator state differs"
        assert got[step]["arrays"].keys() == want[step]["arrays"].keys()
        for path, array in want[step]["arrays"].items():
            other = got[step]["arrays"][path]
            assert other.dtype == array.dtype and other.shape == array.shape, f"{stage} step {step}: {path}"
            assert other.tobytes() == array.tobytes(), f"{stage} step {step}: {path} differs"


def test_the_finished_chain_reports_the_uninterrupted_histories(reference, killed):
    case, attempts = killed
    assert attempts[-1].returncode == 0, f"the rerun after the last kill failed:\n{_log_tail(case)}"
    want, got = (json.loads((c / "done.json").read_text()) for c in (reference, case))
    assert got == want
