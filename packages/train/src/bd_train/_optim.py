"""Optimizer configuration: AdamW with warmup + decay schedules and global-norm clipping (optax).

`OptimizerConfig` is frozen and validated on construction; `make_optimizer` turns it into an optax
transformation, optionally with injected hyperparameters so the learning rate lives in the state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NoReturn

import jax
import jax.numpy as jnp
import optax

from bd_core import config_error

Schedule = Literal["constant", "cosine", "linear"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyperparameters and the learning-rate schedule.

    The schedule warms up linearly from 0 over `warmup_steps`, then holds (`constant`) or decays
    (`cosine`, `linear`) to `learning_rate * end_lr_ratio` at `total_steps`.

    Attributes:
        learning_rate: the peak learning rate.
        schedule: `constant`, `cosine` or `linear` after warmup.
        warmup_steps: steps of linear warmup from 0.
        total_steps: the updates the schedule decays over (required unless `constant`).
        end_lr_ratio: the decayed learning rate as a fraction of the peak.
        b1: Adam's first-moment decay.
        b2: Adam's second-moment decay.
        eps: Adam's epsilon.
        weight_decay: decoupled weight decay, on every weight but the RMSNorm gains (`decays`).
        max_grad_norm: global-norm clipping (None: off).
        mu_dtype: the dtype of Adam's first moment (None: the parameters').
        inject_hyperparams: keep the learning rate in the optimizer state, so it can be read and changed.
    """

    learning_rate: float = 3e-4
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    mu_dtype: str | None = None
    inject_hyperparams: bool = False

    def __post_init__(self):
        def fail(field: str, expected: str, fix: str) -> NoReturn:
            raise config_error("OptimizerConfig", field, getattr(self, field), expected, fix)

        if not self.learning_rate > 0:
            fail("learning_rate", "a value > 0", "use a positive value such as 3e-4")
        if self.schedule not in ("constant", "cosine", "linear"):
            fail("schedule", "'constant', 'cosine' or 'linear'", "use one of those")
        if self.warmup_steps < 0:
            fail("warmup_steps", "a value >= 0", "use 0 for no warmup")
        if self.schedule != "constant":
            if self.total_steps is None:
                fail("total_steps", f"the number of updates with schedule={self.schedule!r}",
                     "set it to the number of optimizer updates, or use schedule='constant'")
            if self.total_steps <= self.warmup_steps:
                fail("total_steps", f"more than warmup_steps ({self.warmup_steps})",
                     "raise total_steps or lower warmup_steps")
        if not 0 <= self.end_lr_ratio <= 1:
            fail("end_lr_ratio", "a value in [0, 1]", "use e.g. 0.1")
        for field in ("b1", "b2"):
            if not 0 <= getattr(self, field) < 1:
                fail(field, "a value in [0, 1)", "use e.g. 0.9 / 0.999")
        if not self.eps > 0:
            fail("eps", "a value > 0", "use e.g. 1e-8")
        if self.weight_decay < 0:
            fail("weight_decay", "a value >= 0", "use 0 to disable it")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            fail("max_grad_norm", "a value > 0 or None", "use None to disable clipping")
        if self.mu_dtype is not None:
            try:
                jnp.dtype(self.mu_dtype)
            except TypeError:
                fail("mu_dtype", "a dtype name", "use e.g. 'bfloat16', 'float32' or None")

    def learning_rate_schedule(self) -> optax.Schedule:
        """The learning rate per step: linear warmup, then constant, cosine or linear decay to `end_lr_ratio` of the
        peak."""
        peak = self.learning_rate
        if self.schedule == "constant":
            after: Any = optax.constant_schedule(peak)
        else:
            assert self.total_steps is not None  # validated: a decaying schedule has total_steps
            decay_steps = self.total_steps - self.warmup_steps
            end = peak * self.end_lr_ratio
            if self.schedule == "cosine":
                after = optax.cosine_decay_schedule(peak, decay_steps, alpha=self.end_lr_ratio)
            else:
                after = optax.linear_schedule(peak, end, decay_steps)
        if self.warmup_steps == 0:
            return after
        warmup = optax.linear_schedule(0.0, peak, self.warmup_steps)
        return optax.join_schedules([warmup, after], [self.warmup_steps])


def decays(params: Any) -> Any:
    """Which parameters weight decay pulls toward 0 (a tree of bools like `params`): every one but
    the RMSNorm gains (`*_norm`), whose neutral value is 1, not 0."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


def applied_updates(opt_state: Any) -> jax.Array | None:
    """How many updates the optimizer has applied (AdamW's step count, which a skipped update
    does not advance, and which the learning-rate schedule follows); None for an optimizer state
    that keeps no count."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[0][1] if counts else None


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """`clip_by_global_norm` (if set) then AdamW on the configured schedule."""
    kwargs: dict[str, Any] = dict(
        learning_rate=config.learning_rate_schedule(),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mu_dtype=None if config.mu_dtype is None else jnp.dtype(config.mu_dtype),
    )
    if config.weight_decay > 0:  # masked only then: the optimizer state's tree stays as saved before
        kwargs["mask"] = decays
    if config.inject_hyperparams:
        # Without an explicit dtype optax stores hyperparameters in the parameters' dtype, and in
        # bfloat16 b2=0.999 rounds to 1.0, which zeroes Adam's bias correction (inf updates).
        adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",), hyperparam_dtype=jnp.float32)(**kwargs)
    else:
        adamw = optax.adamw(**kwargs)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
