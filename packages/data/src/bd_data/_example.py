"""The unit of data: a prompt, its reference answer, and where it came from.

Tasks and the JSONL loader both produce `Example`s; the pipelines turn them into canvases.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """`prompt` and reference `answer` text; `index` is the example's index in its source.

    `prompt_ids`/`answer_ids`, when set, are the token ids to use instead of encoding the text
    (the JSONL loader stores them after truncating an over-long example).

    Attributes:
        prompt: the prompt text.
        answer: the reference answer text.
        index: the example's index in its source.
        prompt_ids: token ids to use instead of encoding `prompt`.
        answer_ids: token ids to use instead of encoding `answer`.
    """

    prompt: str
    answer: str
    index: int = -1
    prompt_ids: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    answer_ids: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def token_ids(self, tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, answer ids) as int32 arrays, without special tokens."""
        prompt = tokenizer.encode(self.prompt) if self.prompt_ids is None else self.prompt_ids
        answer = tokenizer.encode(self.answer) if self.answer_ids is None else self.answer_ids
        return np.asarray(prompt, np.int32), np.asarray(answer, np.int32)
