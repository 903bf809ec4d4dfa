"""The task interface: random-access examples of two disjoint splits and a bounded-time reward.

`Task` is what trainers use; `GeneratedTask` adds the split rule of generated problems: a problem
belongs to eval iff a hash of its prompt falls in the eval bucket (independent of the seed), and
example i of a split is the first draw of its own seed stream (seed, split, i, attempt) that lands
in that split's bucket. So the splits never share a prompt and example i depends only on (seed, split, i).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from bd_core import config_error

from ._example import Example

SPLITS = ("train", "eval")
CORRECT = 1.0
PARTIAL_CREDIT = 0.1
"""The reward of a well-formed answer that is wrong (an exact answer gets 1, anything else 0)."""
MALFORMED = 0.0
EVAL_PERMILLE = 100  # 10% of each problem space is held out for eval
ENDLESS = 1 << 20  # the size of a generated split's dataset unless asked otherwise
_MAX_ATTEMPTS = 10_000


def in_eval(prompt: str) -> bool:
    """Whether `prompt` belongs to the eval split (a seed-independent hash bucket)."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < EVAL_PERMILLE


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")


@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
    """A verifiable task; subclasses are frozen dataclasses whose fields are its params.
    `file_params` names the params that are paths of data files it reads (what a run pins by
    their bytes); a generated task reads none."""

    seed: int = 0
    name: ClassVar[str]
    file_params: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise config_error(type(self).__name__, "seed", self.seed, "an int >= 0")

    def _check_range(self, field: str, low: int, high: int) -> None:
        value = getattr(self, field)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise config_error(type(self).__name__, field, value, f"an int in [{low}, {high}]")

    @abc.abstractmethod
    def example(self, index: int, split: str = "train") -> Example:
        """Example `index` of `split` (deterministic)."""

    @abc.abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """A finite score in [0, 1] for any input, in bounded time; 1.0 means correct."""

    def split_size(self, split: str) -> int:
        """How many examples `split` holds; generated splits are practically endless."""
        check_split(split)
        return ENDLESS

    def dataset(self, split: str = "train", size: int | None = None) -> TaskSource:
        """The examples of `split` as a random-access source for grain (`size` caps it)."""
        return TaskSource(self, split, self.split_size(split) if size is None else size)

    def is_correct(self, example: Example, completion: str) -> bool:
        """Whether the completion earns the full reward."""
        return self.reward(example, completion) == CORRECT


@dataclasses.dataclass(frozen=True)
class GeneratedTask(Task):
    """A task whose problems come from `_draw`, split by the prompt-hash rule above."""

    @abc.abstractmethod
    def _draw(self, rng: np.random.Generator) -> tuple[str, str]:
        """One random (prompt, answer)."""

    def example(self, index: int, split: str = "train") -> Example:
        """The `index`-th example of `split`, drawn from the task's seed; eval prompts never occur in train."""
        check_split(split)
        if index < 0:
            raise IndexError(f"example index must be >= 0, got {index}")
        want_eval = split == "eval"
        for attempt in range(_MAX_ATTEMPTS):
            seq = np.random.SeedSequence([self.seed, SPLITS.index(split), index, attempt])
            prompt, answer = self._draw(np.random.default_rng(seq))
            if in_eval(prompt) == want_eval:
                return Example(prompt, answer, index)
        raise ValueError(f"{self!r}: found no {split} problem in {_MAX_ATTEMPTS} draws; the problem space is too small")


@dataclasses.dataclass(frozen=True)
class TaskSource(Sequence):
    """`size` examples of one split, random access (a grain `MapDataset` source)."""

    task: Task
    split: str = "train"
    size: int = ENDLESS

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a source of {self.size} examples")
        return self.task.example(int(index), self.split)
