"""W&B tracking: one run per pipeline stage, offline unless the user opts in.

W&B writes caches and settings outside its `dir` unless every one of its folder variables points
inside the run folder, so `Tracker` sets them all before `wandb.init`. A stage's W&B run id is a
digest of its folder, project, pipeline run and stage, so a resumed stage continues the same W&B
run (offline, each attempt writes its own `offline-run-*` folder under that id; `wandb sync` of
them all fills one run).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def wandb_mode() -> str:
    """`WANDB_MODE` if the user set it; online when a key is configured; offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _scalar(value: Any) -> float | int | Any:
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        arr = np.asarray(value)
        if arr.ndim == 0:
            return arr.item()
    return value


def stage_run_id(root: str | Path, project: str, group: str, stage: str) -> str:
    """The W&B run id of a stage: the same for every attempt of it (resume), distinct otherwise."""
    digest = hashlib.sha256(f"{Path(root).resolve()}\n{project}\n{group}\n{stage}".encode()).hexdigest()
    return f"bdlm-{digest[:24]}"


class Tracker:
    """A W&B run for one stage: `group` is the pipeline run, `job_type` the stage, and the run id
    `stage_run_id(...)`, so that a resumed stage logs into the run it started (`resume="allow"`)."""

    def __init__(self, *, root: str | Path, project: str, stage: str, group: str, config: Mapping[str, Any],
                 name: str | None = None, mode: str | None = None):
        import wandb  # heavy import, only where tracking is used

        self.dir = Path(root).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", ".cache"), ("WANDB_DATA_DIR", ".data"),
                         ("WANDB_CONFIG_DIR", ".config")):
            path = self.dir / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.mode: Any = mode or wandb_mode()  # online / offline / disabled, checked by wandb
        self._wandb = wandb
        self.run = wandb.init(
            project=project, group=group, job_type=stage, name=name or f"{group}-{stage}",
            id=stage_run_id(self.dir, project, group, stage), resume="allow",
            config=dict(config), dir=str(self.dir), mode=self.mode, reinit="create_new",
        )

    @property
    def run_dir(self) -> Path | None:
        return Path(self.run.dir).parent if self.run is not None and self.run.dir else None

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Log scalar metrics at `step`."""
        self.run.log({key: _scalar(value) for key, value in metrics.items()}, step=int(step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                  step: int | None = None) -> None:
        """Log a table (W&B `Table`) of `rows` under `name`."""
        table = self._wandb.Table(columns=list(columns), data=[list(map(_scalar, row)) for row in rows])
        self.run.log({name: table}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set values in the run's W&B summary."""
        for key, value in values.items():
            self.run.summary[key] = _scalar(value)

    def finish(self, exit_code: int = 0) -> None:
        """Finish the W&B run (an offline run is then complete on disk); a nonzero `exit_code`
        marks it failed."""
        self.run.finish(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind, *exc) -> None:
        # a stage that stops on an error, a guard's stop or a preemption is not a finished run
        self.finish(exit_code=0 if kind is None else 1)
