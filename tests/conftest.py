"""What the flow tests share: the flow, the environment its runs get, and a run that is made to
fail inside a stage (after a checkpoint) and is then finished by `resume`."""

from pathlib import Path

import pytest

FLOW = str(Path(__file__).resolve().parents[1] / "flows" / "bd_pipeline.py")


class FlowRuns:
    flow = FLOW

    def __init__(self, xla_flags: str):
        self.xla_flags = xla_flags

    def env(self, **extra) -> dict:
        # The datastore is found from the working directory (`<cwd>/.metaflow`), a temp dir here.
        # EQX_ON_ERROR: as `test_sigkill._env`, so that the samplers' programs reach the session's
        # compilation cache (JAX never caches a program with a host callback).
        return {"METAFLOW_USER": "tester", "WANDB_MODE": "offline", "BDLM_PROGRESS": "0", "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": self.xla_flags, "EQX_ON_ERROR": "nan", **extra}

    def crash_and_resume(self, preset: Path, cwd: Path, *, fault: str = "grpo:2", **extra: str):
        """Run `preset` with the stage failing after the step `fault` names ("<stage>:<step>"),
        then `resume` it (`extra`: more environment); returns the resumed run and the failed
        run's id."""
        from metaflow import Runner

        env = self.env(BDLM_FAIL_AFTER=fault, **extra)  # flows/bd_nodes.py: the stage fails after saving that step
        with Runner(FLOW, show_output=False, cwd=str(cwd), env=env, config=[("config", str(preset))]).run(
                max_workers=2) as failed:
            assert failed.status == "failed", failed.stdout[-3000:] + failed.stderr[-3000:]
            assert f"simulated failure after step {fault.split(':')[1]}" in failed.stdout + failed.stderr
            origin = failed.run.id
        with Runner(FLOW, show_output=False, cwd=str(cwd), env=env).resume(origin_run_id=origin) as resumed:
            assert resumed.status == "successful", resumed.stdout[-3000:] + resumed.stderr[-3000:]
            return resumed.run, origin


@pytest.fixture(scope="session")
def flow_runs(child_xla_flags) -> FlowRuns:
    return FlowRuns(child_xla_flags)
