"""Per-position functions of the logits, computed a slice of the positions at a time.

`map_logits(model, layout, fn, *per_position)` is `fn(model(layout), *per_position)` for an `fn`
that treats every position on its own (a cross-entropy, a divergence, a token's log-prob). With the
model's `logits_chunk` C > 0 it runs `fn` on the logits of C positions of every row at a time, in
a scan whose steps are checkpointed, so the backward pass recomputes a chunk's logits instead of
storing them: the `[B, T, V]` float32 logits (and `fn`'s temporaries of that size) are never live
at once, only `[B, C, V]`. Chunks cut the position axis, so rows keep their data-parallel sharding. (tokamax's
`linear_softmax_cross_entropy_loss` fuses the head and an unweighted CE reduced to one number: no
per-token weights, metrics, temperature, sampling filters or teacher, so none of these losses.)
Shape letters: see bd_core (B, T, D, V); C positions per chunk, N whole chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from bd_core import ViewLayout

from ._unroll import unrolled


def logits_chunk(model: Any) -> int:
    """The model's `config.logits_chunk` (0, the whole logits at once, for a model without one)."""
    return int(getattr(getattr(model, "config", None), "logits_chunk", 0) or 0)


def map_logits(model: Any, layout: ViewLayout, fn: Callable[..., Any], *per_position: Any,
               chunk: int | None = None) -> Any:
    """`fn(logits_BxTxV, *per_position)`, each of `per_position` an array `[B, T, ...]` and every
    output of `fn` (any pytree) `[B, T, ...]`, computed `chunk` positions at a time (default: the
    model's `logits_chunk`; 0 computes the whole logits at once, the reference). Chunking needs a
    model with `features(layout)` and `unembed(h)` (`BlockDiffusionLM`); `fn` must treat each
    position independently, which is what makes the chunked result equal to the whole one."""
    chunk = logits_chunk(model) if chunk is None else int(chunk)
    length = layout.tokens.shape[1]
    if chunk <= 0 or chunk >= length:
        return fn(model(layout), *per_position)
    h_BxTxD = model.features(layout)
    args = tuple(jnp.asarray(a) for a in per_position)

    def piece(start: Any, size: int) -> Any:
        # Everything the piece reads (hidden states, per-position arrays, the head) is loop-invariant:
        # the checkpoint keeps references to them, not per-chunk copies, and recomputes the logits.
        def run(h, xs, start):
            h_BxCxD = lax.dynamic_slice_in_dim(h, start, size, axis=1)
            xs_c = [lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in xs]
            return fn(model.unembed(h_BxCxD), *xs_c)

        return jax.checkpoint(run, prevent_cse=False)(h_BxTxD, args, start)

    whole = length // chunk
    # `lax.map`'s scan, unrolled for XLA's cost analysis inside `unroll_layers` (the same arithmetic)
    _, out = lax.scan(lambda _, i: (None, piece(i * chunk, chunk)), None, jnp.arange(whole, dtype=jnp.int32),
                      unroll=unrolled())
    # [N, B, C, ...] -> [B, N*C, ...]
    out = jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape((y.shape[1], whole * chunk) + y.shape[3:]), out)
    rest = length - whole * chunk
    if rest:
        tail = piece(whole * chunk, rest)
        out = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out, tail)
    return out
