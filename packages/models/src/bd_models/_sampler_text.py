"""Decoding generated completions back to text: valid tokens only, cut before the first stop id."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from bd_core import RolloutOutput

from ._sharding import to_host


@runtime_checkable
class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def completion_ids(rollout: RolloutOutput, *, stop_ids: Iterable[int] = ()) -> list[list[int]]:
    """Per row, the generated token ids up to (not including) the first stop id. A rollout sampled
    on a mesh that spans processes is gathered first, so every process decodes every row."""
    stops = set(int(s) for s in stop_ids)
    tokens, valid = to_host((rollout.completion_tokens, rollout.completion_valid))
    rows = []
    for row_tokens, row_valid in zip(tokens, valid):
        ids = []
        for token in row_tokens[row_valid].tolist():
            if token in stops:
                break
            ids.append(token)
        rows.append(ids)
    return rows


def decode_completions(tokenizer: Decoder, rollout: RolloutOutput, *, stop_ids: Iterable[int] = ()) -> list[str]:
    """The text of each row's completion; everything from the first stop id on is dropped."""
    return [tokenizer.decode(ids) for ids in completion_ids(rollout, stop_ids=stop_ids)]
