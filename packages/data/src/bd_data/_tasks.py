"""Built-in verifiable tasks: deterministic random-access generators with bounded-time rewards.

Example i of a split depends only on (seed, split, i). Train and eval never share a problem: a
problem belongs to eval iff a hash of its prompt falls in the eval bucket (independent of the
seed), and each split draws until it hits its own bucket. Rewards match a digit-only pattern on
a length-capped string (no `eval`, no int parsing), so any input is scored in linear time.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from bd_core import config_error

from ._example import Example

SPLITS = ("train", "eval")
CORRECT, PARTIAL_CREDIT, MALFORMED = 1.0, 0.1, 0.0
EVAL_PERMILLE = 100  # 10% of each problem space is held out for eval
_MAX_REWARD_CHARS = 256  # longer completions are malformed; bounds the work on adversarial text
_MAX_ATTEMPTS = 10_000


def _in_eval(prompt: str) -> bool:
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < EVAL_PERMILLE


@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
    """A verifiable task; subclasses are frozen dataclasses whose fields are difficulty params."""

    seed: int = 0
    name: ClassVar[str]

    @abc.abstractmethod
    def _draw(self, rng: np.random.Generator) -> tuple[str, str]:
        """One random (prompt, answer)."""

    @abc.abstractmethod
    def _answer_pattern(self) -> str:
        """Regex that a well-formed answer matches in full."""

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise config_error(type(self).__name__, "seed", self.seed, "an int >= 0")

    def _check_range(self, field: str, low: int, high: int) -> None:
        value = getattr(self, field)
        if not isinstance(value, int) or not low <= value <= high:
            raise config_error(type(self).__name__, field, value, f"an int in [{low}, {high}]")

    def example(self, index: int, split: str = "train") -> Example:
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        if index < 0:
            raise IndexError(f"example index must be >= 0, got {index}")
        want_eval = split == "eval"
        for attempt in range(_MAX_ATTEMPTS):
            seq = np.random.SeedSequence([self.seed, SPLITS.index(split), index, attempt])
            prompt, answer = self._draw(np.random.default_rng(seq))
            if _in_eval(prompt) == want_eval:
                return Example(prompt, answer, index)
        raise ValueError(f"{self!r}: found no {split} problem in {_MAX_ATTEMPTS} draws; the problem space is too small")

    def dataset(self, split: str = "train", size: int = 1 << 20) -> TaskSource:
        return TaskSource(self, split, size)

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

    def is_correct(self, example: Example, completion: str) -> bool:
        return self.reward(example, completion) == CORRECT


@dataclasses.dataclass(frozen=True)
class TaskSource(Sequence):
    """`size` examples of one split, random access (a grain `MapDataset` source)."""

    task: Task
    split: str = "train"
    size: int = 1 << 20

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a source of {self.size} examples")
        return self.task.example(int(index), self.split)


@dataclasses.dataclass(frozen=True)
class SortTask(Task):
    """`"315926="` → `"123569"`: sort a compact digit string."""

    length: int = 6
    name: ClassVar[str] = "sort"

    def __post_init__(self):
        super().__post_init__()
        self._check_range("length", 2, 16)

    def _draw(self, rng):
        digits = rng.integers(0, 10, self.length)
        return "".join(map(str, digits)) + "=", "".join(map(str, np.sort(digits)))

    def _answer_pattern(self):
        return f"[0-9]{{{self.length}}}"


@dataclasses.dataclass(frozen=True)
class ArgsortTask(Task):
    """`"315926="` → `"140253"`: the positions of a stable ascending sort."""

    length: int = 6
    name: ClassVar[str] = "argsort"

    def __post_init__(self):
        super().__post_init__()
        self._check_range("length", 2, 10)  # positions are single digits

    def _draw(self, rng):
        digits = rng.integers(0, 10, self.length)
        order = np.argsort(digits, kind="stable")
        return "".join(map(str, digits)) + "=", "".join(map(str, order))

    def _answer_pattern(self):
        return f"[0-9]{{{self.length}}}"


@dataclasses.dataclass(frozen=True)
class AdditionTask(Task):
    """`"042+317="` → `"359"`: operands zero-padded to `digits`, the sum without padding."""

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


TASKS: dict[str, type[Task]] = {t.name: t for t in (SortTask, ArgsortTask, AdditionTask, AdditionLSDTask)}
# Measured (BENCHMARKS.md, bench/sft_weighting.py): 6-digit sort saturates at 100% within 300
# steps, leaving nothing for distillation or GRPO; 6-digit argsort separates a 0.47M teacher from
# an 86k student and keeps rising, so it is the pipeline's task. Plain addition is far too slow.
DEFAULT_TASK = "argsort"


def get_task(name: str, **params) -> Task:
    """The task `name` with difficulty params (and `seed`), e.g. `get_task("addition", digits=3)`."""
    if name not in TASKS:
        raise config_error("", "task", name, f"one of {sorted(TASKS)}")
    cls = TASKS[name]
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise config_error(cls.__name__, unknown[0], params[unknown[0]],
                           f"a parameter of task {name!r} (one of {sorted(allowed)})", "drop it")
    return cls(**params)
