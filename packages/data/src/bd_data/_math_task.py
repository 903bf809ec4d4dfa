"""Math problems from the user's JSONL (`{"prompt": ..., "answer": ...}` per line), scored by math-verify.

Splits: with `eval_path` that file is eval, and train drops every record whose prompt is also in it;
without it, one file is split by the generated tasks' prompt-hash rule. Either way no prompt is in
both. A reward screens the text (length, characters, nesting, power towers) and then runs
math-verify in a worker process under a deadline (`_bounded_verify`), from any thread.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import ClassVar

from bd_core import config_error

from ._bounded_verify import start_verify_worker, verify_math
from ._example import Example
from ._jsonl import JsonlError, read_records
from ._task import CORRECT, EVAL_PERMILLE, MALFORMED, Task, check_split, in_eval

FIELDS = ("prompt", "answer")
# math-verify's LaTeX parser spends ~0.05-0.1 s per level of nested ( or [ (measured: 8 levels
# ~0.6 s, 32 levels ~4 s) while braces cost next to nothing, so the two are capped apart.
MAX_PAREN_DEPTH, MAX_BRACE_DEPTH = 6, 16
# Shapes that make sympy compute for minutes, rejected before any parsing: power towers
# (`9**9**9`, `9^{9^9}`, `9^(9^9)`) and exponents or factorials of five digits or more. The
# deadline covers whatever else is slow; these just cost nothing.
_EXPLOSIVE = re.compile(r"(?:\^|\*\*)\s*(?:\{[^{}]*(?:\^|\*\*)|\([^()]*(?:\^|\*\*)|[0-9.]+\s*(?:\^|\*\*)"
                        r"|[{(]?\s*[0-9]{5})|[0-9]{5}\s*!(?!=)")


def screened(text: object, max_chars: int) -> bool:
    """Whether `text` may go to math-verify: a non-blank str of at most `max_chars` printable
    characters (newlines and tabs allowed, no U+FFFD from a failed decode), brackets nested within
    the depths above, and none of the explosive shapes above. Linear in `max_chars` at worst."""
    if not isinstance(text, str) or len(text) > max_chars or not text.strip() or "\ufffd" in text:
        return False
    parens = braces = 0
    for char in text:
        if not (char.isprintable() or char in "\n\t"):
            return False
        parens += (char in "([") - (char in ")]")
        braces += (char == "{") - (char == "}")
        if parens > MAX_PAREN_DEPTH or braces > MAX_BRACE_DEPTH:
            return False
    return _EXPLOSIVE.search(text) is None


@dataclasses.dataclass(frozen=True)
class MathTask(Task):
    """The records of `path` (and `eval_path`), rewarded 1.0 when math-verify finds the completion
    equal to the answer and 0.0 otherwise (also when screened out or past `timeout_s`).

    `seed` has no effect: the examples are the file's, in file order, and the split is by prompt.

    Attributes:
        path: a JSONL file of `{"prompt": ..., "answer": ...}` objects to train on.
        eval_path: a JSONL file of held-out problems, or None to hold out a share of `path`'s
            prompts.
        max_chars: completions longer than this score 0 without being parsed (1 to 100,000).
        timeout_s: seconds math-verify may take on one completion, in (0, 60]; past it the reward
            is 0.
    """

    path: str = ""
    eval_path: str | None = None
    max_chars: int = 512
    timeout_s: float = 1.0
    name: ClassVar[str] = "math"
    file_params: ClassVar[tuple[str, ...]] = ("path", "eval_path")

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        for field in ("path", "eval_path"):
            value = getattr(self, field)
            if not (isinstance(value, str) and value) and not (field == "eval_path" and value is None):
                raise config_error(owner, field, value, "the path of a JSONL file with 'prompt' and 'answer' per line")
            if value is not None and not Path(value).is_file():
                raise config_error(owner, field, value, "an existing JSONL file with 'prompt' and 'answer' per line",
                                   f"nothing is at {str(Path(value).absolute())!r} (a relative path starts at the "
                                   f"folder the command runs in)")
        self._check_range("max_chars", 1, 100_000)
        timeout = self.timeout_s
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 60:
            raise config_error(owner, "timeout_s", timeout, "a number of seconds in (0, 60]")
        self.split_size("train")  # reads the files now: a bad line fails here, naming file and line
        start_verify_worker()  # its ~1-2 s of imports overlap with whatever runs before the first reward

    @functools.cached_property
    def _rows(self) -> dict[str, tuple[tuple[str, tuple[str, ...]], ...]]:
        """Per split, each problem's `file:line` and its (prompt, answer)."""
        records = [(f"{self.path}:{line}", values) for line, values in read_records(Path(self.path), FIELDS)]
        if self.eval_path is None:
            held = [r for r in records if in_eval(r[1][0])]
            train = [r for r in records if not in_eval(r[1][0])]
        else:
            held = [(f"{self.eval_path}:{line}", values)
                    for line, values in read_records(Path(self.eval_path), FIELDS)]
            prompts = {values[0] for _, values in held}
            train = [r for r in records if r[1][0] not in prompts]
        if not train:
            raise JsonlError(f"{self.path}: no training records left ({len(records)} read, all of them eval prompts)")
        if not held:
            raise JsonlError(
                f"{self.path}: none of its {len(records)} records falls in the eval split (about "
                f"{EVAL_PERMILLE / 10:g}% of prompts do); pass eval_path= with held-out records")
        return {"train": tuple(train), "eval": tuple(held)}

    @functools.cached_property
    def _splits(self) -> dict[str, tuple[Example, ...]]:
        return {split: tuple(Example(p, a, i) for i, (_, (p, a)) in enumerate(rows))
                for split, rows in self._rows.items()}

    def where(self, index: int, split: str = "train") -> str:
        """The file and line (`path:line`) the `index`-th example of `split` comes from."""
        check_split(split)
        return self._rows[split][index][0]

    def split_size(self, split: str) -> int:
        """The number of examples in `split` (`"train"` or `"eval"`)."""
        check_split(split)
        return len(self._splits[split])

    def example(self, index: int, split: str = "train") -> Example:
        """The `index`-th example of `split` as the JSONL file has it."""
        check_split(split)
        rows = self._splits[split]
        if not 0 <= index < len(rows):
            raise IndexError(f"example {index} out of range: the {split} split of {self.path} has {len(rows)}")
        return rows[index]

    def reward(self, example: Example, completion: str) -> float:
        """1 if math-verify finds the completion equivalent to the answer (within the time limit), else 0."""
        if not screened(completion, self.max_chars):
            return MALFORMED
        return CORRECT if verify_math(example.answer, completion, timeout_s=self.timeout_s) else MALFORMED
