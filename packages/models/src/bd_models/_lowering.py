"""Programs lowered from shapes: `lower(fn, *args)` is `jax.jit(fn).lower(*args)` for Equinox-style
arguments whose arrays may be `jax.ShapeDtypeStruct`s (with shardings, on any devices: a TPU
topology's, for an ahead-of-time plan) and whose other leaves are static; `lower_sample` is the
sampler's program lowered that way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._sampler import _generate
from ._sampler_config import SamplerConfig


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def lower(fn: Callable[..., Any], *args: Any) -> jax.stages.Lowered:
    """The program `fn(*args)` compiles to, lowered and not run: arrays and `ShapeDtypeStruct`s
    in `args` are its inputs (their shardings kept), everything else is baked in as static.
    `.compile()` gives `memory_analysis()` and `cost_analysis()` for the devices the shardings
    name, whether or not this host has them."""
    dynamic, static = eqx.partition(args, _is_dynamic)
    return jax.jit(lambda d: fn(*eqx.combine(d, static))).lower(dynamic)


def lower_sample(model: Any, prompt_tokens: Any, prompt_valid: Any, config: SamplerConfig, *,
                 key: Any) -> jax.stages.Lowered:
    """`sample`'s KV-cached program for prompts of this shape (`[B, P]` int32 tokens, bool valid),
    lowered from `lower`'s kind of arguments; the config's numeric leaves stay traced, as in
    `sample`."""
    return lower(_generate, model, prompt_tokens, prompt_valid, key, config)
