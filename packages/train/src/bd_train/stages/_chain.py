"""The stage chain without an orchestrator: teacher and student SFT, OPD, GRPO, called in order on
every process of a group, with the same stage functions the Metaflow flow calls (so the two
cannot drift). A run id that does not change makes a rerun continue: each stage starts from its
latest complete checkpoint, and a finished stage is restored, not retrained.
"""

from __future__ import annotations

from typing import Any

import jax

from ._compat import check_adopted, check_distillation_pair
from ._driver import StageResult
from ._run import RunDir
from ._summary import summarize
from .grpo import run_grpo
from .opd import run_opd
from .sft import run_sft

STAGES = ("sft", "opd", "grpo")
# The flow's summary rows, by stage: what `summarize` reads.
ROWS = {"sft-teacher": "teacher_sft", "sft-student": "student_sft", "opd": "student_opd", "grpo": "student_grpo"}


def run_chain(config: Any, where: RunDir, *, until: str = "grpo") -> dict[str, StageResult]:
    """Every stage up to `until` (`sft`, `opd` or `grpo`), each continuing from its latest complete
    checkpoint; `{stage: StageResult}`. The whole chain ends with the summary the flow's `end`
    writes (`<output_dir>/latest/summary.json`, printed)."""
    if until not in STAGES:
        raise ValueError(f"until: expected one of {STAGES}, got {until!r}")
    check_adopted(config)  # before anything trains, as the flow's `start`
    results = {f"sft-{role}": run_sft(config, where, role=role) for role in ("teacher", "student")}
    if until == "sft":
        return results
    check_distillation_pair(results["sft-teacher"], results["sft-student"])
    results["opd"] = run_opd(config, where, teacher=results["sft-teacher"], student=results["sft-student"])
    if until == "opd":
        return results
    results["grpo"] = run_grpo(config, where, start=results["opd"])
    if jax.process_index() == 0:  # one summary, as the flow's `end` step writes it
        summarize({ROWS[stage]: result for stage, result in results.items()}, where)
    return results
