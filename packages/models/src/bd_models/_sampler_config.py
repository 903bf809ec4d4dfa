"""`SamplerConfig`: the frozen, validated settings of the block-diffusion denoising sampler.

Lengths, the sampling distribution (temperature -> top-k -> top-p, banned mask/pad ids), the commit
strategy and confidence rule, and stop ids. Every error names the field and how to fix it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

STRATEGIES = ("threshold", "steps")
CONFIDENCE_RULES = ("probability", "margin", "entropy")


class SamplerConfigError(ValueError):
    """A sampler config field with an invalid value."""


def _fail(field: str, message: str) -> None:
    raise SamplerConfigError(f"SamplerConfig.{field}: {message}")


def _check_int(field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(field, f"expected an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How to denoise `max_new_tokens` (a multiple of `block_size`) block by block.

    Distribution: logits / `temperature` (0 = greedy), then the `top_k` largest, then the smallest
    set with mass >= `top_p`, renormalized; `mask_id` and `pad_id` are never sampled.
    Commit strategy per step: `threshold` commits every masked position whose confidence is >=
    `threshold` (at least the most confident one), for at most `max_steps_per_block` steps
    (default `block_size`); `steps` commits `block_size / steps_per_block` positions per step
    (default one per step). The last allowed step commits everything left. Confidence is the
    sampled token's `probability`, the top-1 minus top-2 `margin`, or `entropy` as exp(-H); all lie
    in [0, 1] (greedy decoding scores it at temperature 1). A row stops after the block that
    contains one of `stop_ids`.
    """

    block_size: int
    max_new_tokens: int
    mask_id: int
    pad_id: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    strategy: str = "threshold"
    threshold: float = 0.9
    steps_per_block: int | None = None
    max_steps_per_block: int | None = None
    confidence: str = "probability"
    stop_ids: Sequence[int] = ()

    def __post_init__(self):
        _check_int("block_size", self.block_size, 1)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.max_new_tokens % self.block_size:
            up = -(-self.max_new_tokens // self.block_size) * self.block_size
            _fail("max_new_tokens", f"{self.max_new_tokens} is not a multiple of block_size={self.block_size}; "
                                    f"use {up}")
        _check_int("mask_id", self.mask_id, 0)
        _check_int("pad_id", self.pad_id, 0)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):
            _fail("temperature", f"expected a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1)
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0 < self.top_p <= 1):
            _fail("top_p", f"expected a number in (0, 1] or None to disable, got {self.top_p!r}")
        if self.strategy not in STRATEGIES:
            _fail("strategy", f"expected one of {STRATEGIES}, got {self.strategy!r}")
        if self.confidence not in CONFIDENCE_RULES:
            _fail("confidence", f"expected one of {CONFIDENCE_RULES}, got {self.confidence!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0 <= self.threshold <= 1:
            _fail("threshold", f"expected a number in [0, 1] (confidences lie in [0, 1]), got {self.threshold!r}")
        if self.strategy == "steps":
            if self.max_steps_per_block is not None:
                _fail("max_steps_per_block", "applies to strategy='threshold'; with strategy='steps' set "
                                             "steps_per_block instead")
            if self.steps_per_block is not None:
                self._check_steps("steps_per_block", self.steps_per_block)
        else:
            if self.steps_per_block is not None:
                _fail("steps_per_block", "applies to strategy='steps'; with strategy='threshold' set "
                                         "max_steps_per_block instead")
            if self.max_steps_per_block is not None:
                self._check_steps("max_steps_per_block", self.max_steps_per_block)
        try:
            stop_ids = tuple(self.stop_ids)
        except TypeError:
            _fail("stop_ids", f"expected a sequence of token ids, got {self.stop_ids!r}")
        for token in stop_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                _fail("stop_ids", f"expected token ids >= 0, got {token!r} in {stop_ids}")
            if token in (self.mask_id, self.pad_id):
                _fail("stop_ids", f"{token} is the mask or pad id, which is never sampled; drop it")
        object.__setattr__(self, "stop_ids", stop_ids)  # lists become tuples: the config stays hashable

    def _check_steps(self, field: str, value: Any) -> None:
        _check_int(field, value, 1)
        if value > self.block_size:
            _fail(field, f"{value} exceeds block_size={self.block_size}; every step commits at least one "
                         f"token, so use at most {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return self.max_new_tokens // self.block_size

    @property
    def steps_cap(self) -> int:
        """The most denoising steps one block can take (the trace reserves this many per block)."""
        if self.strategy == "steps":
            return self.steps_per_block or self.block_size
        return self.max_steps_per_block or self.block_size

    @property
    def banned_ids(self) -> tuple[int, ...]:
        return tuple(sorted({self.mask_id, self.pad_id}))

    def distribution_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `sampling_logprobs` (and trace scoring) for this config."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, banned_ids=self.banned_ids)

    def check_vocab(self, vocab_size: int) -> None:
        """Ids must exist in the model's vocabulary; top-k must leave something to sample."""
        for field in ("mask_id", "pad_id"):
            if getattr(self, field) >= vocab_size:
                _fail(field, f"{getattr(self, field)} is outside the model's vocab_size={vocab_size}")
        for token in self.stop_ids:
            if token >= vocab_size:
                _fail("stop_ids", f"{token} is outside the model's vocab_size={vocab_size}")
        if self.top_k is not None and self.top_k > vocab_size:
            _fail("top_k", f"{self.top_k} exceeds vocab_size={vocab_size}; use at most {vocab_size} or None")

    def replace(self, **changes: Any) -> SamplerConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
