"""Masking corruption of a batch of canvases into the SFT layout `[clean prompt+completion | noisy completion]`.

Per valid completion block t ~ U[t_min, t_max] (stratified over the batch on request); each valid
token is masked with probability 1 - alpha(t) (= t for the linear schedule), at least one per block.
Shape letters: see bd_core (B, P, N, C = P + N, b).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, cast

import numpy as np

from bd_core import DiffusionTokenBatch, ViewLayout, config_error

from ._canvas import Canvas, CanvasConfig

SCHEDULES = ("linear", "cosine")
WEIGHTINGS = ("elbo", "none")


@dataclasses.dataclass(frozen=True)
class CorruptionConfig:
    """Noise level range, schedule, loss weighting and whether t is stratified over the batch.

    `weighting="elbo"`: masked tokens weigh -alpha'(t) / (1 - alpha(t)) (1/t for linear) and the
    denominator counts valid completion tokens (the per-token NELBO); `"none"`: masked tokens
    weigh 1 and the denominator counts masked tokens.
    """

    t_min: float = 0.1
    t_max: float = 1.0
    schedule: Literal["linear", "cosine"] = "linear"
    weighting: Literal["elbo", "none"] = "none"
    stratified: bool = False

    def __post_init__(self):
        owner, expected = "CorruptionConfig", "0 < t_min <= t_max <= 1"
        fix = "t_min > 0 keeps elbo weights finite (e.g. t_min=0.1, t_max=1.0)"
        if not 0.0 < self.t_min <= 1.0:
            raise config_error(owner, "t_min", self.t_min, f"{expected} (t_max={self.t_max})", fix)
        if not self.t_min <= self.t_max <= 1.0:
            raise config_error(owner, "t_max", self.t_max, f"{expected} (t_min={self.t_min})", fix)
        if self.schedule not in SCHEDULES:
            raise config_error(owner, "schedule", self.schedule, f"one of {SCHEDULES}")
        if self.weighting not in WEIGHTINGS:
            raise config_error(owner, "weighting", self.weighting, f"one of {WEIGHTINGS}")
        if not isinstance(self.stratified, bool):
            raise config_error(owner, "stratified", self.stratified, "a bool")

    def mask_rate(self, t: np.ndarray) -> np.ndarray:
        """1 - alpha(t): the probability that a token is masked at noise level t."""
        t = np.asarray(t, np.float64)
        return t if self.schedule == "linear" else 1.0 - np.cos(0.5 * math.pi * t)

    def elbo_weight(self, t: np.ndarray) -> np.ndarray:
        """-alpha'(t) / (1 - alpha(t))."""
        t = np.asarray(t, np.float64)
        if self.schedule == "linear":
            return 1.0 / t
        half = 0.5 * math.pi * t
        return 0.5 * math.pi * np.sin(half) / (1.0 - np.cos(half))


# Measured by bench/sft_weighting.py (BENCHMARKS.md): on 6-digit argsort an 86k-parameter student
# reached the best held-out accuracy with `none` on U[0.1, 1] (mean over 3 seeds 23.5% of the
# learning curve, vs 20.2% `none` U[0.3, 0.8], 16.0% `elbo` U[0.3, 0.8], 0.7% `elbo` U[1e-3, 1]).
DEFAULT_CORRUPTION = CorruptionConfig(t_min=0.1, t_max=1.0, schedule="linear", weighting="none")


def sample_t(block_valid: np.ndarray, config: CorruptionConfig, rng: np.random.Generator) -> np.ndarray:
    """t per completion block `[B, N/b]`; stratified: the batch's m valid blocks get one draw from
    each of m equal-width strata of [t_min, t_max], in random order."""
    span = config.t_max - config.t_min
    if not config.stratified:
        return config.t_min + span * rng.random(block_valid.shape)
    t = np.full(block_valid.shape, config.t_min + 0.5 * span)
    count = int(block_valid.sum())
    if count:
        t[block_valid] = config.t_min + span * (rng.permutation(count) + rng.random(count)) / count
    return t


def corrupt(canvas: Canvas, canvas_config: CanvasConfig, config: CorruptionConfig, *, mask_id: int,
            rng: np.random.Generator) -> DiffusionTokenBatch:
    """Corrupt a batch of clean canvases (`[B, C]` arrays, C = P + N) into a numpy
    `DiffusionTokenBatch` of length C + N; the noisy copy carries the completion's positions and
    block ids.

    Bias of the at-least-one rule. Given t, a block of n valid tokens has n*p + (1 - p)^n masked
    tokens in expectation instead of n*p. Under `elbo` weighting (linear) the weighted loss of a
    constant per-token loss c therefore estimates c * (1 + E_t[(1 - t)^n / (n t)]) rather than c:
    for n = 4 that factor is 1.164 on t ~ U[0.1, 1], 1.042 on U[0.3, 0.8] and 2.21 on U[1e-3, 1]
    (`test_corruption.py` checks these numbers against sampled batches). Under `none` weighting
    the loss is a ratio over masked tokens and stays exactly c; only the effective mask rate rises.
    Clipping t is free for the linear schedule (E[weighted count | t] = n for every t) but not for
    cosine, whose clipped estimate is c * (alpha(t_min) - alpha(t_max)) / (t_max - t_min).
    """
    p, b = canvas_config.prompt_len, canvas_config.block_size
    batch, length = canvas.tokens.shape
    n = length - p
    clean, valid = canvas.tokens[:, p:], canvas.valid[:, p:]
    valid_blocks = valid.reshape(batch, n // b, b)
    # [B, N/b]: numpy's stubs allow a scalar for any reduction, but this one is over the last axis of a 3-D array
    block_valid = cast(np.ndarray, valid_blocks.any(-1))

    t = sample_t(block_valid, config, rng)
    rate = np.repeat(config.mask_rate(t), b, axis=1)
    masked = (rng.random((batch, n)) < rate) & valid
    # At least one mask per valid block: where none was drawn, mask one valid token uniformly.
    keys = np.where(valid_blocks, rng.random(valid_blocks.shape), -1.0)
    forced = np.zeros_like(valid_blocks)
    np.put_along_axis(forced, keys.argmax(-1)[..., None], True, axis=-1)
    empty = block_valid & ~masked.reshape(batch, n // b, b).any(-1)
    masked |= (forced & empty[..., None]).reshape(batch, n)

    if config.weighting == "elbo":
        token_weight = np.repeat(config.elbo_weight(t), b, axis=1)
        weights, denom = np.where(masked, token_weight, 0.0), valid.astype(np.float64)
    else:
        weights, denom = masked.astype(np.float64), masked.astype(np.float64)

    zeros = np.zeros((batch, length), np.float32)
    layout = ViewLayout(
        tokens=np.concatenate([canvas.tokens, np.where(masked, mask_id, clean)], axis=1).astype(np.int32),
        positions=np.concatenate([canvas.positions, canvas.positions[:, p:]], axis=1).astype(np.int32),
        block_ids=np.concatenate([canvas.block_ids, canvas.block_ids[:, p:]], axis=1).astype(np.int32),
        view_ids=np.concatenate([np.zeros((batch, length), np.int32), np.ones((batch, n), np.int32)], axis=1),
        valid=np.concatenate([canvas.valid, valid], axis=1),
    )
    return DiffusionTokenBatch(
        layout=layout,
        targets=np.concatenate([np.zeros((batch, length), np.int32), np.where(valid, clean, 0)],
                               axis=1).astype(np.int32),
        weights=np.concatenate([zeros, weights.astype(np.float32)], axis=1),
        denom_weights=np.concatenate([zeros, denom.astype(np.float32)], axis=1),
    ).validate()
