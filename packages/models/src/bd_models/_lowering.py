"""Programs lowered from shapes: `lower(fn, *args)` is `jax.jit(fn).lower(*args)` for Equinox-style
arguments whose arrays may be `jax.ShapeDtypeStruct`s (with shardings, on any devices: a TPU
topology's, for an ahead-of-time plan) and whose other leaves are static; `lower_sample` is the
sampler's program lowered that way, and `lower_denoising_step` one step of its denoising loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._sampler import _Block, _denoising_step, _empty_trace, _generate
from ._sampler_config import SamplerConfig


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def lower(fn: Callable[..., Any], *args: Any, out_shardings: Any = None) -> jax.stages.Lowered:
    """The program `fn(*args)` compiles to, lowered and not run: arrays and `ShapeDtypeStruct`s
    in `args` are its inputs (their shardings, and layouts where given, kept), everything else is
    baked in as static; `out_shardings` places its outputs (shardings or `Format`s, as
    `jax.jit` takes them; None leaves them to the compiler). `.compile()` gives
    `memory_analysis()` and `cost_analysis()` for the devices the shardings name, whether or not
    this host has them."""
    dynamic, static = eqx.partition(args, _is_dynamic)
    placed = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(lambda d: fn(*eqx.combine(d, static)), **placed).lower(dynamic)


def lower_sample(model: Any, prompt_tokens: Any, prompt_valid: Any, config: SamplerConfig, *,
                 key: Any) -> jax.stages.Lowered:
    """`sample`'s KV-cached program for prompts of this shape (`[B, P]` int32 tokens, bool valid),
    lowered from `lower`'s kind of arguments; the config's numeric leaves stay traced, as in
    `sample`."""
    return lower(_generate, model, prompt_tokens, prompt_valid, key, config)


def lower_denoising_step(model: Any, cache: Any, config: SamplerConfig, *, prompt_len: int, key: Any,
                         sharding: Any = None) -> jax.stages.Lowered:
    """One step of `sample`'s denoising loop (a block's noisy view against the KV cache `cache`,
    then sampling, the commit and the trace record), for the rows of `cache` (a `KVCache` of
    shapes, e.g. `eqx.filter_eval_shape(model.init_cache, rows, prompt_len + max_new_tokens)`
    placed on a mesh), lowered from `lower`'s kind of arguments: the program whose cost, times the
    steps of a rollout, is the rollout's. The loop state's per-row arrays are placed with
    `sharding` (that of the batch's leading axis), or left to the compiler."""
    rows, b = cache.valid.shape[0], config.block_size

    def shaped(x: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if x.ndim else None)

    state = jax.eval_shape(lambda: _Block(jnp.int32(0), jnp.zeros((rows, b), jnp.int32), jnp.ones((rows, b), bool),
                                          _empty_trace(rows, config.num_blocks * config.steps_cap, b),
                                          jnp.zeros((rows,), jnp.int32)))
    state = jax.tree.map(shaped, state)
    active = shaped(jax.ShapeDtypeStruct((rows,), np.bool_))
    j = jax.ShapeDtypeStruct((), np.int32)
    return lower(lambda m, c, s, j, a, k: _denoising_step(m, c, m.layer_list(), s, j, a, k, config, prompt_len),
                 model, cache, state, j, active, key)
