"""The canvas: where a prompt and its completion sit, which slots are valid, their positions/blocks.

A canvas has `prompt_len + max_new_tokens` slots. The prompt is left-padded into the first P slots
so the completion starts at slot P, a block boundary; the completion is `answer + eos`, eos-filled
to the end of its last block, and later blocks are invalid. Block id = slot // block_size.
Shape letters: see bd_core (P prompt, N new tokens, C = P + N canvas, b block size).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from bd_core import config_error

POLICIES = ("block_aligned", "contiguous")
OVERLONG_POLICIES = ("error", "truncate", "skip")


class CanvasOverflow(ValueError):
    """An example whose prompt or completion does not fit the canvas."""


@dataclasses.dataclass(frozen=True)
class CanvasConfig:
    """`prompt_len` P and `max_new_tokens` N, both multiples of `block_size` b.

    `policy`: `block_aligned` — the RoPE position of a slot is its index (padding counted);
    `contiguous` — the same slots and blocks, but positions skip the padding (the first prompt
    token is position 0 and the completion continues right after the prompt). `bd_models.sample`
    decodes at block-aligned positions (it takes no positions): a model trained on `contiguous`
    ones would be sampled at positions it did not train on, which is why the pipeline, whose
    stages sample, refuses `contiguous`; it is for SFT and likelihoods on their own.

    Attributes:
        prompt_len: P, prompt tokens (a multiple of `block_size`); prompts are left-padded to it.
        max_new_tokens: N, completion tokens (a multiple of `block_size`).
        block_size: b, tokens per block: bidirectional inside a block, causal across blocks (1: autoregressive).
            In a preset that starts from a pretrained checkpoint, left out it is the checkpoint's.
        policy: RoPE positions: `block_aligned` (a slot's index, padding counted) or `contiguous` (padding skipped).
    """

    prompt_len: int = 16
    max_new_tokens: int = 8
    block_size: int = 4
    policy: Literal["block_aligned", "contiguous"] = "block_aligned"

    def __post_init__(self):
        for name in ("prompt_len", "max_new_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise config_error("CanvasConfig", name, value, "a positive int")
        for name in ("prompt_len", "max_new_tokens"):
            value = getattr(self, name)
            if value % self.block_size:
                raise config_error("CanvasConfig", name, value, f"a multiple of block_size={self.block_size}",
                                   f"round it up to {-(-value // self.block_size) * self.block_size}")
        if self.policy not in POLICIES:
            raise config_error("CanvasConfig", "policy", self.policy, f"one of {POLICIES}")

    @property
    def length(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def num_blocks(self) -> int:
        return self.length // self.block_size

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_len // self.block_size


@dataclasses.dataclass(frozen=True)
class Canvas:
    """One clean canvas, all `[P + N]`: tokens, valid, positions, block ids.

    Attributes:
        tokens: `[P + N]` token ids.
        valid: `[P + N]` False for padding.
        positions: `[P + N]` RoPE positions.
        block_ids: `[P + N]` canvas blocks.
    """

    tokens: np.ndarray
    valid: np.ndarray
    positions: np.ndarray
    block_ids: np.ndarray


def _positions(config: CanvasConfig, prompt_count: int) -> np.ndarray:
    slots = np.arange(config.length, dtype=np.int32)
    if config.policy == "block_aligned":
        return slots
    # Padding slots get 0; they are invalid, so their position is never used.
    return np.maximum(slots - (config.prompt_len - prompt_count), 0).astype(np.int32)


def _check_fits(prompt_ids: np.ndarray, answer_ids: np.ndarray | None, config: CanvasConfig) -> None:
    if len(prompt_ids) > config.prompt_len:
        raise CanvasOverflow(
            f"prompt has {len(prompt_ids)} tokens but CanvasConfig.prompt_len={config.prompt_len}; raise prompt_len "
            f"or shorten the prompt"
        )
    if answer_ids is not None and len(answer_ids) + 1 > config.max_new_tokens:
        raise CanvasOverflow(
            f"completion needs {len(answer_ids) + 1} tokens (answer {len(answer_ids)} + eos) but "
            f"CanvasConfig.max_new_tokens={config.max_new_tokens}; raise max_new_tokens or shorten the answer"
        )


def fit_to_canvas(prompt_ids, answer_ids, config: CanvasConfig, overlong: str = "error"):
    """Apply an over-long policy: returns (prompt_ids, answer_ids, truncated) or None to skip.

    `truncate` keeps the last `prompt_len` prompt tokens (nearest the answer) and the first
    `max_new_tokens - 1` answer tokens (room for eos).
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong: expected one of {OVERLONG_POLICIES}, got {overlong!r}")
    prompt_ids, answer_ids = np.asarray(prompt_ids, np.int32), np.asarray(answer_ids, np.int32)
    try:
        _check_fits(prompt_ids, answer_ids, config)
        return prompt_ids, answer_ids, False
    except CanvasOverflow:
        if overlong == "error":
            raise
        if overlong == "skip":
            return None
    prompt_ids = prompt_ids[max(len(prompt_ids) - config.prompt_len, 0):]
    return prompt_ids, answer_ids[: config.max_new_tokens - 1], True


def prompt_canvas(prompt_ids, config: CanvasConfig, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The left-padded prompt for generation: tokens `[P]` int32, valid `[P]` bool, and the
    positions `[P + N]` of the whole canvas (generation starts at slot P, a block boundary)."""
    prompt_ids = np.asarray(prompt_ids, np.int32)
    _check_fits(prompt_ids, None, config)
    tokens = np.full(config.prompt_len, tokenizer.pad_id, np.int32)
    valid = np.zeros(config.prompt_len, bool)
    start = config.prompt_len - len(prompt_ids)
    tokens[start:], valid[start:] = prompt_ids, True
    return tokens, valid, _positions(config, len(prompt_ids))


def build_canvas(prompt_ids, answer_ids, config: CanvasConfig, tokenizer) -> Canvas:
    """The clean training canvas of one example (raises `CanvasOverflow` if it does not fit)."""
    prompt_ids, answer_ids = np.asarray(prompt_ids, np.int32), np.asarray(answer_ids, np.int32)
    _check_fits(prompt_ids, answer_ids, config)
    p, b = config.prompt_len, config.block_size
    prompt_tokens, prompt_valid, positions = prompt_canvas(prompt_ids, config, tokenizer)
    completion_len = -(-(len(answer_ids) + 1) // b) * b  # answer + eos, to the end of its block
    tokens = np.full(config.length, tokenizer.pad_id, np.int32)
    valid = np.zeros(config.length, bool)
    tokens[:p], valid[:p] = prompt_tokens, prompt_valid
    tokens[p : p + completion_len] = tokenizer.eos_id
    tokens[p : p + len(answer_ids)] = answer_ids
    valid[p : p + completion_len] = True
    block_ids = (np.arange(config.length) // b).astype(np.int32)
    return Canvas(tokens, valid, positions, block_ids)
