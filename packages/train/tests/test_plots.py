"""The card pictures: curves in a grid of at most three panels a row, and trace labels that never
show a replacement character (which passes for a digit) for a byte that is not UTF-8 on its own."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from bd_data import ByteTokenizer
from bd_train.stages._plots import curves_png, trace_png, trace_text

KEYS = ("loss", "reward_mean", "reward_std", "kl", "clip_fraction", "grad_norm", "learning_rate")


def _size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


@pytest.mark.parametrize("n, grid", [(1, (1, 1)), (3, (1, 3)), (4, (2, 3)), (6, (2, 3)), (7, (3, 3))])
def test_curves_are_a_grid_of_at_most_three_a_row(n, grid):
    history = [{"step": s, **{k: float(s * (i + 1)) for i, k in enumerate(KEYS[:n])}} for s in range(1, 5)]
    png = curves_png(history, KEYS, title="GRPO (student)")  # keys absent from the history get no panel
    assert png is not None
    rows, cols = grid
    assert _size(png) == (320 * cols, 260 * rows)  # 3.2 x 2.6 inches a panel at 100 dpi


def test_curves_of_no_logged_key_are_no_picture():
    assert curves_png([{"step": 1, "loss": 1.0}], ("reward_mean",), title="t") is None


def test_trace_text_escapes_what_does_not_print_and_marks_only_blanks():
    tok = ByteTokenizer()
    text = trace_text(tok)
    assert [text(t) for t in b"7=a"] == ["7", "=", "a"]
    assert text(0xC3) == "\\xc3"  # a UTF-8 lead byte alone: undecodable, not "�"
    assert text(0x80) == "\\x80" and text(0xFF) == "\\xff"
    assert text(0x07) == "\\x07" and text(ord("\n")) == "\\n" and text(ord("\t")) == "\\t"
    assert text(ord(" ")) == "·"
    assert text(tok.eos_id) == "⏎"
    assert text(tok.pad_id) == f"#{tok.pad_id}"  # decodes to nothing: its id
    assert not any("\ufffd" in text(t) for t in range(tok.vocab_size))
    assert sum(text(t) == "·" for t in range(tok.vocab_size)) == 1  # the space only


def test_a_trace_of_undecodable_bytes_draws():
    tok = ByteTokenizer()
    committed = np.array([[True, False, False, False], [False, True, True, True]])
    tokens = np.array([[0xC3, 0, 0, 0], [0, 0x07, ord(" "), tok.eos_id]])
    png = trace_png(committed=committed, tokens=tokens, step_valid=np.array([True, True]),
                    block_ids=np.array([2, 2]), first_block=2, num_blocks=1, block_size=4,
                    token_text=trace_text(tok), title="trace")
    assert _size(png)[0] > 0


def test_a_wide_trace_shows_its_first_blocks_with_the_steps_that_decoded_them():
    """Past `max_columns`, the picture keeps the first whole blocks and only their steps: its size
    is that of the trace cut to them, whatever the completion's length."""
    tok = ByteTokenizer()
    block, blocks = 4, 32  # a 128-token completion, one token a step
    steps = block * blocks
    committed = np.zeros((steps, block), bool)
    committed[np.arange(steps), np.arange(steps) % block] = True
    tokens = np.full((steps, block), ord("7"))
    block_ids = 3 + np.arange(steps) // block
    kwargs = dict(tokens=tokens, step_valid=np.ones(steps, bool), first_block=3, block_size=block,
                  token_text=trace_text(tok), title="trace")
    wide = trace_png(committed=committed, block_ids=block_ids, num_blocks=blocks, max_columns=8, **kwargs)
    cut = trace_png(committed=committed[:8], block_ids=block_ids[:8], num_blocks=2, max_columns=8,
                    **{**kwargs, "tokens": tokens[:8], "step_valid": np.ones(8, bool)})
    assert _size(wide) == _size(cut)
    assert _size(cut)[0] < 1000
