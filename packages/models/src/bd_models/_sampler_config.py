"""`SamplerConfig`: the validated settings of the block-diffusion denoising sampler.

Lengths, the sampling distribution (a `SamplingDistribution`, with the mask and pad ids banned),
the commit strategy, threshold and confidence rule, and stop ids. Every error names the field and
how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float

from bd_core import config_error

from ._sampling_dist import SamplingDistribution

STRATEGIES = ("threshold", "steps", "random")
CONFIDENCE_RULES = ("probability", "margin", "entropy")
OWNER = "SamplerConfig"
# to_dict's keys, in this order: what fingerprints (`bd_train.rollout_semantics`) read
DICT_KEYS = ("block_size", "max_new_tokens", "mask_id", "pad_id", "temperature", "top_k", "top_p", "strategy",
             "threshold", "steps_per_block", "max_steps_per_block", "confidence", "stop_ids")


def _check_int(field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise config_error(OWNER, field, value, f"an int >= {low}")


class SamplerConfig(eqx.Module):
    """How to denoise `max_new_tokens` (a multiple of `block_size`) block by block.

    Distribution: `distribution` (default `SamplingDistribution()`: temperature 1, no filters),
    stored with `mask_id` and `pad_id` banned, so they are never sampled.
    Commit strategy per step: `threshold` commits every masked position whose confidence is >=
    `threshold` (at least the most confident one), for at most `max_steps_per_block` steps
    (default `block_size`) — a threshold above 1 (e.g. `inf`) commits exactly the most confident
    one, the same positions as `steps` at one per step, in the same compiled program as any other
    threshold; `steps` commits the `block_size / steps_per_block` most confident
    positions per step (default one per step); `random` commits as many per step as `steps`, but
    chosen uniformly at random among the masked positions, independently of the model. The last
    allowed step commits everything left. Confidence is the sampled token's `probability`, the
    top-1 minus top-2 `margin`, or `entropy` as exp(-H), all in [0, 1], always scored under the
    model's own distribution (`SamplingDistribution.unfiltered`: temperature 1, no top-k/top-p), so
    the sampling knobs change what is sampled, never how many positions commit. A row stops after
    the block that contains one of `stop_ids`.

    Which likelihood a trace has: under `random` the schedule (which positions commit at which
    step) does not depend on the parameters, so log pi(trajectory) = `schedule_logprob` (a
    constant) + the sum of the committed tokens' log-probs, and GRPO's importance ratio is the
    exact trajectory ratio (`exact_likelihood`). Under `threshold` and `steps` which positions
    commit depends on the parameters (and, for `threshold`, on draws that are then discarded), so
    the sum of committed log-probs is a surrogate for the trajectory's log-probability.

    The run-time knobs (the distribution's numbers and `threshold`) are 0-d array leaves and
    everything else is static, so `eqx.filter_jit` compiles once per structure and traces the
    knobs. Like the distribution's, `threshold` holds the value as given (a float64 numpy scalar,
    float32 under jit), so `to_dict` returns exactly the configured number. `to_dict`,
    `check_vocab`, `replace` and hashing read the leaves, so they run outside jit.

    Attributes:
        block_size: b, tokens per block.
        max_new_tokens: N, completion tokens (a multiple of `block_size`).
        mask_id: the token that marks a masked position.
        pad_id: the padding token.
        distribution: what is sampled at a position (temperature, top-k, top-p).
        strategy: which positions commit per step: `threshold`, `steps` or `random`.
        threshold: τ, the confidence at which `threshold` commits a position (a traced leaf).
        steps_per_block: denoising steps per block for `steps` and `random`.
        max_steps_per_block: the cap on `threshold`'s steps per block.
        confidence: `probability`, `margin` or `entropy`.
        stop_ids: tokens after whose block a row stops.
    """

    block_size: int = eqx.field(static=True)
    max_new_tokens: int = eqx.field(static=True)
    mask_id: int = eqx.field(static=True)
    pad_id: int = eqx.field(static=True)
    distribution: SamplingDistribution
    strategy: str = eqx.field(static=True)
    threshold: Float[Array | np.ndarray, ""]
    steps_per_block: int | None = eqx.field(static=True)
    max_steps_per_block: int | None = eqx.field(static=True)
    confidence: str = eqx.field(static=True)
    stop_ids: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, block_size: int, max_new_tokens: int, mask_id: int, pad_id: int, *,
                 distribution: SamplingDistribution | None = None, strategy: str = "threshold",
                 threshold: float | int = 0.9, steps_per_block: int | None = None,
                 max_steps_per_block: int | None = None, confidence: str = "probability",
                 stop_ids: Sequence[int] = ()):
        _check_int("block_size", block_size, 1)
        _check_int("max_new_tokens", max_new_tokens, 1)
        if max_new_tokens % block_size:
            up = -(-max_new_tokens // block_size) * block_size
            raise config_error(OWNER, "max_new_tokens", max_new_tokens, f"a multiple of block_size={block_size}",
                               f"use {up}")
        _check_int("mask_id", mask_id, 0)
        _check_int("pad_id", pad_id, 0)
        if distribution is None:
            distribution = SamplingDistribution()
        if not isinstance(distribution, SamplingDistribution):
            raise config_error(OWNER, "distribution", distribution, "a SamplingDistribution")
        if strategy not in STRATEGIES:
            raise config_error(OWNER, "strategy", strategy, f"one of {STRATEGIES}")
        if confidence not in CONFIDENCE_RULES:
            raise config_error(OWNER, "confidence", confidence, f"one of {CONFIDENCE_RULES}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise config_error(OWNER, "threshold", threshold,
                               "a number >= 0 (confidences lie in [0, 1]; above 1, e.g. inf: one position per step)")
        # each strategy has its own step cap; the other one's must stay unset
        (steps_field, steps), (other_field, other) = (
            (("steps_per_block", steps_per_block), ("max_steps_per_block", max_steps_per_block))
            if strategy in ("steps", "random")
            else (("max_steps_per_block", max_steps_per_block), ("steps_per_block", steps_per_block)))
        if other is not None:
            raise config_error(OWNER, other_field, other, f"None with strategy={strategy!r}",
                               f"set {steps_field} instead")
        if steps is not None:
            _check_int(steps_field, steps, 1)
            if steps > block_size:
                raise config_error(OWNER, steps_field, steps, f"at most block_size={block_size}",
                                   "every step commits at least one token")
        try:
            stops = tuple(stop_ids)
        except TypeError:
            raise config_error(OWNER, "stop_ids", stop_ids, "a sequence of token ids") from None
        for token in stops:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise config_error(OWNER, "stop_ids", stops, "token ids >= 0", f"drop {token!r}")
            if token in (mask_id, pad_id):
                raise config_error(OWNER, "stop_ids", stops, "ids that can be sampled",
                                   f"drop {token}: it is the mask or pad id, which is never sampled")
        self.block_size = block_size
        self.max_new_tokens = max_new_tokens
        self.mask_id = mask_id
        self.pad_id = pad_id
        self.distribution = distribution.with_banned((mask_id, pad_id))
        self.strategy = strategy
        self.threshold = np.asarray(threshold, np.float64)
        self.steps_per_block = steps_per_block
        self.max_steps_per_block = max_steps_per_block
        self.confidence = confidence
        self.stop_ids = stops

    @property
    def num_blocks(self) -> int:
        return self.max_new_tokens // self.block_size

    @property
    def steps_cap(self) -> int:
        """The most denoising steps one block can take (the trace reserves this many per block)."""
        if self.strategy in ("steps", "random"):
            return self.steps_per_block or self.block_size
        return self.max_steps_per_block or self.block_size

    @property
    def exact_likelihood(self) -> bool:
        """Whether a trace's committed log-probs give its exact log-probability up to the
        parameter-free `schedule_logprob` (the `random` strategy); otherwise they are a surrogate."""
        return self.strategy == "random"

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """The ids never sampled: the mask and pad ids, and any the distribution bans."""
        return self.distribution.banned_ids

    def check_vocab(self, vocab_size: int) -> None:
        """Ids must exist in the model's vocabulary; top-k must leave something to sample."""
        for field in ("mask_id", "pad_id"):
            if getattr(self, field) >= vocab_size:
                raise config_error(OWNER, field, getattr(self, field), f"an id < the model's vocab_size={vocab_size}")
        for token in self.stop_ids:
            if token >= vocab_size:
                raise config_error(OWNER, "stop_ids", self.stop_ids, f"ids < the model's vocab_size={vocab_size}",
                                   f"drop {token}")
        for token in self.banned_ids:
            if token >= vocab_size:
                raise config_error("SamplingDistribution", "banned_ids", self.banned_ids,
                                   f"ids < the model's vocab_size={vocab_size}", f"drop {token}")
        top_k = self.distribution.to_dict()["top_k"]
        if top_k is not None and top_k > vocab_size:
            raise config_error("SamplingDistribution", "top_k", top_k, f"at most vocab_size={vocab_size}",
                               f"use at most {vocab_size} or None")

    def replace(self, **changes: Any) -> SamplerConfig:
        """A copy with some settings changed (`distribution=` and `threshold=` included), revalidated."""
        unknown = sorted(set(changes) - set(_INIT_FIELDS))
        if unknown:
            raise config_error(OWNER, "replace", unknown, f"settings among {list(_INIT_FIELDS)}")
        current = {name: getattr(self, name) for name in _INIT_FIELDS}
        current["threshold"] = float(self.threshold)
        # the constructor bans the (possibly new) mask and pad ids; drop the ones it added before
        ours = {self.mask_id, self.pad_id}
        current["distribution"] = self.distribution._with(
            banned_ids=tuple(i for i in self.distribution.banned_ids if i not in ours))
        return SamplerConfig(**{**current, **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values under `DICT_KEYS` (the distribution's fields flattened in)."""
        values = {name: getattr(self, name) for name in DICT_KEYS if name in _INIT_FIELDS}
        distribution = self.distribution.to_dict()
        values.update(temperature=distribution["temperature"], top_k=distribution["top_k"],
                      top_p=distribution["top_p"], threshold=float(self.threshold))
        return {name: values[name] for name in DICT_KEYS}

    def __hash__(self) -> int:
        return hash((json.dumps(self.to_dict(), sort_keys=True), self.distribution))


_INIT_FIELDS = ("block_size", "max_new_tokens", "mask_id", "pad_id", "distribution", "strategy", "threshold",
                "steps_per_block", "max_steps_per_block", "confidence", "stop_ids")
