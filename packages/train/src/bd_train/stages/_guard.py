"""OPD's guard: distillation that cannot silently make the student worse.

Before OPD it compares the teacher with the student on the held-out problems; during OPD (at every
periodic checkpoint, `[run] checkpoint_every`) and at its end it compares the student with where
OPD started, paired over the same problems. Each finding is one line on stderr, every comparison
is kept in the checkpoints' metadata (a resumed run decides from the same numbers) and in the
stage's result (summary, card, W&B). `[opd] guard` says what follows:

- `"keep-best"` (default): OPD runs to its end; when its model ends worse than its start, the
  next stage starts from the start instead (`StageResult.kept`).
- `"warn"`: the lines only; the next stage starts from OPD's model.
- `"stop"`: the run stops (`StageError`) where the guard finds the teacher not better or the
  student worse; the checkpoint of that step is saved, so `resume` under another mode goes on.

Decisions use held-out greedy accuracy and its paired 95% bootstrap interval (`_intervals`):
the student is *worse* when the interval of its change lies wholly below zero, the teacher *not
better* when the interval of teacher − student does not lie wholly above zero. The interval, not
the point estimate, decides because these problems are also the ones the summary reports: a
checkpoint chosen on a difference of a few problems would be chosen by chance, and the choice
would flatter the numbers it is reported with.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from ._errors import StageError
from ._intervals import Interval, paired_interval

if TYPE_CHECKING:
    from ._evaluate import Evaluation

GUARD_MODES = ("keep-best", "warn", "stop")  # as `[opd] guard` takes them


def _accuracy_change(after: Evaluation, before: Evaluation) -> Interval:
    return paired_interval(after.per_problem()["accuracy"], before.per_problem()["accuracy"])


def comparable(evaluation: Evaluation | None, n: int) -> bool:
    """Whether `evaluation` holds per-problem results of the `n` held-out problems."""
    return evaluation is not None and len(evaluation.rewards) == n


@dataclasses.dataclass
class Guard:
    """The guard of one OPD run: `start` is the student's evaluation where OPD starts, `teacher`
    the teacher's (None: not compared); `points` the comparisons made so far, by step."""

    mode: str
    start: Evaluation
    teacher: Evaluation | None = None
    points: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    said: list[str] = dataclasses.field(default_factory=list)
    teacher_change: Interval | None = None
    kept_start: bool = False

    def __post_init__(self):
        if self.mode not in GUARD_MODES:
            raise StageError(f"opd.guard: expected one of {list(GUARD_MODES)}, got {self.mode!r}")

    def _say(self, line: str) -> None:
        self.said.append(line)
        print(line, file=sys.stderr)

    def _stop(self, line: str) -> StageError:
        return StageError(f"{line}; stopped ([opd] guard = \"stop\"; with \"keep-best\" or \"warn\" `resume` goes on "
                          "from here)")

    def before(self) -> None:
        """Compare teacher and student before OPD trains; in `stop` mode, a teacher that is not
        better ends the run here."""
        if self.teacher is None:
            return
        change = self.teacher_change = _accuracy_change(self.teacher, self.start)
        if change.low > 0:
            return
        line = (f"opd guard: the teacher is not better than the student on {change.n} held-out problems "
                f"(greedy accuracy {self.teacher.accuracy:.3f} vs {self.start.accuracy:.3f}, paired change "
                f"{change.text()}); OPD may not help")
        self._say(line)
        if self.mode == "stop":
            raise self._stop(line)

    def restore(self, points: list[dict[str, Any]]) -> None:
        """The comparisons a checkpoint recorded, for a resumed stage: each is judged (and said)
        again as when it was made, so `stop` stops again where the interrupted run stopped."""
        self.points = []
        for point in points:
            if self._judge(dict(point)):
                raise self.stop_error()

    def observe(self, step: int, evaluation: Evaluation, *, final: bool = False) -> bool:
        """Compare the student at `step` with the start and record it; says so when it is worse.
        Returns whether the stage must stop (`stop` mode; the caller saves first, then raises
        `stop_error`). At the `final` step, `keep-best` keeps the start if the student is worse."""
        change = _accuracy_change(evaluation, self.start)
        return self._judge({"step": int(step), "accuracy": evaluation.accuracy, "final": final,
                            "change": change.to_dict()})

    def _judge(self, point: dict[str, Any]) -> bool:
        self.points = [p for p in self.points if p["step"] != point["step"]] + [point]
        change = Interval.from_dict(point["change"])
        if change.high >= 0:
            return False
        line = (f"opd guard: at step {point['step']} the student is worse than where OPD started, on {change.n} "
                f"held-out problems (greedy accuracy {point['accuracy']:.3f} vs {self.start.accuracy:.3f}, paired "
                f"change {change.text()})")
        if self.mode == "keep-best" and point["final"]:
            self.kept_start = True
            line += "; the next stage starts from OPD's start"
        elif self.mode == "keep-best":
            line += "; OPD goes on, and its start is kept if it ends so"
        self._say(line)
        return self.mode == "stop"

    def stop_error(self) -> StageError:
        """The error a "stop" guard raises: its latest finding and how to go on."""
        return self._stop(self.said[-1])

    def metrics(self, step: int) -> dict[str, float]:
        """The comparison at `step`, for W&B."""
        point = next(p for p in self.points if p["step"] == step)
        change = point["change"]
        return {"guard/accuracy": point["accuracy"], "guard/change": change["estimate"],
                "guard/change_low": change["low"], "guard/change_high": change["high"]}

    def record(self) -> dict[str, Any]:
        """JSON-ready: the mode, the start's and teacher's accuracy, each comparison, what was kept
        and the lines said."""
        return {"mode": self.mode, "start_accuracy": self.start.accuracy,
                "teacher_accuracy": None if self.teacher is None else self.teacher.accuracy,
                "teacher_change": None if self.teacher_change is None else self.teacher_change.to_dict(),
                "points": [dict(p) for p in self.points], "kept": "start" if self.kept_start else "opd",
                "said": list(self.said)}
