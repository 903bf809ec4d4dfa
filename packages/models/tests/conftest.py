"""Random packed layouts for the bd_models tests: a left-padded clean canvas, then noisy views.

`make_layout` returns the layout and a description of its parts so tests can rebuild the same
computation incrementally (KV cache) or pick the queries of one view.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bd_core import ViewLayout


@dataclasses.dataclass(frozen=True)
class Packed:
    layout: ViewLayout
    prompt_len: int
    canvas_len: int
    block_size: int
    # (view id, canvas block, start index in the packed layout) for every noisy view.
    views: tuple[tuple[int, int, int], ...]


def make_layout(seed: int, *, batch: int = 2, prompt_blocks: int = 2, completion_blocks: int = 3,
                block_size: int = 4, views_per_block: int = 1, vocab: int = 50, tail_pad: int = 3) -> Packed:
    """Clean canvas `[prompt | completion]` with per-row left padding and per-row invalid trailing
    completion blocks, then `views_per_block` noisy views of each completion block, then padding."""
    rng = np.random.default_rng(seed)
    b = block_size
    prompt_len, canvas_len = prompt_blocks * b, (prompt_blocks + completion_blocks) * b
    pos = np.arange(canvas_len)
    clean_valid = np.ones((batch, canvas_len), bool)
    for row in range(batch):
        clean_valid[row, : rng.integers(0, prompt_len)] = False
        dead_blocks = rng.integers(0, completion_blocks)  # blocks after the row's stop are invalid
        clean_valid[row, canvas_len - dead_blocks * b:] = False
    parts = [(pos, pos // b, np.zeros(canvas_len, int), clean_valid)]
    views, start, view_id = [], canvas_len, 1
    for block in range(prompt_blocks, prompt_blocks + completion_blocks):
        for _ in range(views_per_block):
            span = np.arange(block * b, (block + 1) * b)
            parts.append((span, span // b, np.full(b, view_id), clean_valid[:, span]))
            views.append((view_id, block, start))
            start, view_id = start + b, view_id + 1
    tail = np.arange(tail_pad)
    parts.append((tail, np.zeros(tail_pad, int), np.zeros(tail_pad, int), np.zeros((batch, tail_pad), bool)))
    positions = np.concatenate([np.broadcast_to(p, (batch, len(p))) for p, *_ in parts], axis=1)
    block_ids = np.concatenate([np.broadcast_to(k, (batch, len(k))) for _, k, _, _ in parts], axis=1)
    view_ids = np.concatenate([np.broadcast_to(v, (batch, len(v))) for _, _, v, _ in parts], axis=1)
    valid = np.concatenate([np.broadcast_to(m, (batch, m.shape[1])) for *_, m in parts], axis=1)
    tokens = rng.integers(0, vocab, size=positions.shape)
    layout = ViewLayout.create(tokens, positions, block_ids, view_ids, valid)
    return Packed(layout, prompt_len, canvas_len, b, tuple(views))


@pytest.fixture
def layouts():
    return make_layout
