"""Masking corruption of a batch of canvases into the SFT layout
`[clean prompt+completion | noisy completion 1 | ... | noisy completion K]`.

Per valid completion block of each noisy view, t ~ U[t_min, t_max] (stratified over the batch on
request); each valid token is masked with probability 1 - alpha(t) (= t for the linear schedule), at
least one per block. The K views of a sequence are independent corruptions of it that share its one
clean stream: the attention rule keeps views apart, so each view's logits equal those of a
one-view layout of it, while the clean stream's cost is paid once.
Shape letters: see bd_core (B, P, N, C = P + N, b, K views).
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
    """Noise level range, schedule, loss weighting, whether t is stratified over the batch, and the
    number of noisy views per clean sequence.

    `weighting="elbo"`: masked tokens weigh -alpha'(t) / (1 - alpha(t)) (1/t for linear) and the
    denominator counts valid completion tokens (the per-token NELBO); `"none"`: masked tokens
    weigh 1 and the denominator counts masked tokens. Both sum over the `views` views, so a
    K-view batch estimates the same loss as a one-view batch, from K draws of the noise.

    Attributes:
        t_min: the lowest noise level t drawn per block.
        t_max: the highest noise level t drawn per block.
        schedule: the mask rate at noise level t: `linear` (t) or `cosine`.
        weighting: `none` (plain mean cross-entropy over masked tokens) or `elbo` (1/t-style weights, the NELBO).
        stratified: spread t evenly over the batch instead of drawing it independently.
        views: noisy copies of each sequence per batch row.
    """

    t_min: float = 0.1
    t_max: float = 1.0
    schedule: Literal["linear", "cosine"] = "linear"
    weighting: Literal["elbo", "none"] = "none"
    stratified: bool = False
    views: int = 1

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
        if isinstance(self.views, bool) or not isinstance(self.views, int) or self.views < 1:
            raise config_error(owner, "views", self.views, "an int >= 1 (noisy views per clean sequence)")

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
"""The corruption SFT uses unless told otherwise: t ~ U[0.1, 1], linear schedule, plain mean cross-entropy (no 1/t
weights)."""


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
    `DiffusionTokenBatch` of length C + K*N (K = `config.views`); each noisy copy carries the
    completion's positions and block ids and its own view id 1..K. With K = 1 the draws are those
    of the one-view layout; view k's draws depend on K (they come from one `[B, K*N]` draw).

    Bias of the at-least-one rule. Given t, a block of n valid tokens has n*p + (1 - p)^n masked
    tokens in expectation instead of n*p. Under `elbo` weighting (linear) the weighted loss of a
    constant per-token loss c therefore estimates c * (1 + E_t[(1 - t)^n / (n t)]) rather than c:
    for n = 4 that factor is 1.164 on t ~ U[0.1, 1], 1.042 on U[0.3, 0.8] and 2.21 on U[1e-3, 1]
    (`test_corruption.py` checks these numbers against sampled batches). Under `none` weighting
    the loss is a ratio over masked tokens and stays exactly c; only the effective mask rate rises.
    Clipping t is free for the linear schedule (E[weighted count | t] = n for every t) but not for
    cosine, whose clipped estimate is c * (alpha(t_min) - alpha(t_max)) / (t_max - t_min).
    """
    p, b, views = canvas_config.prompt_len, canvas_config.block_size, config.views
    batch, length = canvas.tokens.shape
    n = (length - p) * views  # the noisy views side by side, [B, K*N]
    clean, valid = np.tile(canvas.tokens[:, p:], (1, views)), np.tile(canvas.valid[:, p:], (1, views))
    valid_blocks = valid.reshape(batch, n // b, b)
    # [B, K*N/b]: numpy's stubs allow a scalar for any reduction, but this one is over the last axis of a 3-D array
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
    view_ids = np.repeat(np.arange(1, views + 1, dtype=np.int32), length - p)
    layout = ViewLayout(
        tokens=np.concatenate([canvas.tokens, np.where(masked, mask_id, clean)], axis=1).astype(np.int32),
        positions=np.concatenate([canvas.positions, np.tile(canvas.positions[:, p:], (1, views))],
                                 axis=1).astype(np.int32),
        block_ids=np.concatenate([canvas.block_ids, np.tile(canvas.block_ids[:, p:], (1, views))],
                                 axis=1).astype(np.int32),
        view_ids=np.concatenate([np.zeros((batch, length), np.int32), np.tile(view_ids, (batch, 1))], axis=1),
        valid=np.concatenate([canvas.valid, valid], axis=1),
    )
    return DiffusionTokenBatch(
        layout=layout,
        targets=np.concatenate([np.zeros((batch, length), np.int32), np.where(valid, clean, 0)],
                               axis=1).astype(np.int32),
        weights=np.concatenate([zeros, weights.astype(np.float32)], axis=1),
        denom_weights=np.concatenate([zeros, denom.astype(np.float32)], axis=1),
    ).validate()
