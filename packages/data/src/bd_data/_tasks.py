"""The built-in tasks and their registry: `get_task(name, seed=..., **params)`.

Digit tasks (sort, argsort, addition, addition_lsd) are generated here; countdown, mini_sudoku and
chain_sum come from reasoning-gym (`_rg_tasks`); math reads the user's JSONL (`_math_task`). Digit
rewards match a digit-only pattern on a length-capped string (no `eval`, no int parsing), so any
input is scored in linear time.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import ClassVar, Literal

import numpy as np

from bd_core import config_error

from ._example import Example
from ._math_task import MathTask
from ._rg_tasks import ChainSumTask, CountdownTask, MiniSudokuTask
from ._task import CORRECT, MALFORMED, PARTIAL_CREDIT, GeneratedTask, Task

_MAX_REWARD_CHARS = 256  # longer completions are malformed; bounds the work on adversarial text


@dataclasses.dataclass(frozen=True)
class PatternTask(GeneratedTask):
    """A generated task with one exact answer; a wrong answer of the right form earns PARTIAL_CREDIT."""

    @abc.abstractmethod
    def _answer_pattern(self) -> str:
        """Regex that a well-formed answer matches in full."""

    def _pattern(self) -> re.Pattern:
        return re.compile(self._answer_pattern())

    def reward(self, example: Example, completion: str) -> float:
        """1.0 exact, PARTIAL_CREDIT when well-formed but wrong, 0.0 when malformed."""
        if not isinstance(completion, str) or len(completion) > _MAX_REWARD_CHARS:
            return MALFORMED
        text = completion.strip()
        if text == example.answer:
            return CORRECT
        return PARTIAL_CREDIT if self._pattern().fullmatch(text) else MALFORMED


@dataclasses.dataclass(frozen=True)
class PositionalTask(PatternTask):
    """A pattern task whose answer is `length` digits, each right or wrong on its own. `credit`:
    `"form"` — a well-formed wrong answer earns PARTIAL_CREDIT; `"positions"` — it earns the
    fraction of its positions that are right (below 1, since one is wrong), a denser reward.

    Attributes:
        length: digits in a problem and in its answer (`sort`: 2 to 16; `argsort`: 2 to 10).
        credit: `"form"` or `"positions"` (above).
    """

    length: int = 6
    credit: Literal["form", "positions"] = "form"

    def __post_init__(self):
        super().__post_init__()
        if self.credit not in ("form", "positions"):
            raise config_error(type(self).__name__, "credit", self.credit, "'form' or 'positions'")

    def _answer_pattern(self):
        return f"[0-9]{{{self.length}}}"

    def reward(self, example: Example, completion: str) -> float:
        score = super().reward(example, completion)
        if self.credit == "form" or score != PARTIAL_CREDIT:
            return score
        text = completion.strip()  # well formed: exactly `length` digits, as is the answer
        return sum(a == b for a, b in zip(text, example.answer)) / self.length


@dataclasses.dataclass(frozen=True)
class SortTask(PositionalTask):
    """`"315926="` → `"123569"`: sort a compact digit string."""

    name: ClassVar[str] = "sort"

    def __post_init__(self):
        super().__post_init__()
        self._check_range("length", 2, 16)

    def _draw(self, rng):
        digits = rng.integers(0, 10, self.length)
        return "".join(map(str, digits)) + "=", "".join(map(str, np.sort(digits)))


@dataclasses.dataclass(frozen=True)
class ArgsortTask(PositionalTask):
    """`"315926="` → `"140253"`: the positions of a stable ascending sort."""

    name: ClassVar[str] = "argsort"

    def __post_init__(self):
        super().__post_init__()
        self._check_range("length", 2, 10)  # positions are single digits

    def _draw(self, rng):
        digits = rng.integers(0, 10, self.length)
        order = np.argsort(digits, kind="stable")
        return "".join(map(str, digits)) + "=", "".join(map(str, order))


@dataclasses.dataclass(frozen=True)
class AdditionTask(PatternTask):
    """`"042+317="` → `"359"`: operands zero-padded to `digits`, the sum without padding.

    Attributes:
        digits: digits of each operand, 1 to 18 (`addition_lsd` too).
    """

    digits: int = 3
    name: ClassVar[str] = "addition"

    def __post_init__(self):
        super().__post_init__()
        self._check_range("digits", 1, 18)

    def _operands(self, rng) -> tuple[int, int]:
        high = 10**self.digits
        return int(rng.integers(0, high)), int(rng.integers(0, high))

    def _draw(self, rng):
        a, b = self._operands(rng)
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}=", str(a + b)

    def _answer_pattern(self):
        return f"[0-9]{{1,{self.digits + 1}}}"


@dataclasses.dataclass(frozen=True)
class AdditionLSDTask(AdditionTask):
    """Least-significant digit first: operands and sum written reversed (`"240+713="` → `"953"`),
    so each answer digit depends only on digits already seen and a carry."""

    digits: int = 2
    name: ClassVar[str] = "addition_lsd"

    def _draw(self, rng):
        a, b = self._operands(rng)
        return f"{a:0{self.digits}d}"[::-1] + "+" + f"{b:0{self.digits}d}"[::-1] + "=", str(a + b)[::-1]


TASKS: dict[str, type[Task]] = {t.name: t for t in (SortTask, ArgsortTask, AdditionTask, AdditionLSDTask,
                                                     CountdownTask, MiniSudokuTask, ChainSumTask, MathTask)}
"""Every built-in task class by its name in `get_task` and `[task] name`."""
# Measured (BENCHMARKS.md, bench/sft_weighting.py): 6-digit sort saturates at 100% within 300
# steps, leaving nothing for distillation or GRPO; 6-digit argsort separates a 0.47M teacher from
# an 86k student and keeps rising (the `argsort` preset). Plain addition is far too slow.
DEFAULT_TASK = "argsort"
"""The task `get_task` and `[task] name` default to: 6-digit argsort."""


def get_task(name: str, **params) -> Task:
    """The task `name` with its params (and `seed`), e.g. `get_task("countdown", max_numbers=3)`.

    Args:
        name: a name of `TASKS` (`sort`, `argsort`, `addition`, `addition_lsd`, `countdown`,
            `mini_sudoku`, `chain_sum`, `math`).
        **params: the task's own parameters, and `seed` (which problems it draws).

    Returns:
        The task: train and eval splits that share no prompt, and a bounded-time `reward`.

    Example:
        ```python
        from bd_data import get_task

        task = get_task("argsort", length=6)
        example = task.example(0, "eval")  # Example(prompt="315926=", answer="140253"), say
        assert task.reward(example, example.answer) == 1.0
        ```
    """
    if name not in TASKS:
        raise config_error("", "task", name, f"one of {sorted(TASKS)}")
    cls = TASKS[name]
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise config_error(cls.__name__, unknown[0], params[unknown[0]],
                           f"a parameter of task {name!r} (one of {sorted(allowed)})", "drop it")
    return cls(**params)
