"""Per-position functions of the logits, computed a slice of the positions at a time.

`map_logits(model, layout, fn, *per_position)` is `fn(model(layout), *per_position)` for an `fn`
that treats every position on its own (a cross-entropy, a divergence, a token's log-prob). With the
model's `logits_chunk` C > 0 it runs `fn` on the logits of C positions of every row at a time, in
a scan whose steps are checkpointed, so the backward pass recomputes a chunk's logits instead of
storing them: the `[B, T, V]` float32 logits (and `fn`'s temporaries of that size) are never live
at once, only `[B, C, V]`. Chunks cut the position axis, so rows keep their data-parallel sharding.
`sum_logits` is the same for a weighted sum over positions (SFT, OPD), with the gradient taken in
the forward pass instead: no recomputation, and nothing of the loss's inputs kept for the backward.
(tokamax's `linear_softmax_cross_entropy_loss` fuses the head and an unweighted CE reduced to one
number: no per-token weights, metrics, temperature, sampling filters or teacher, so none of these.)
Shape letters: see bd_core (B, T, D, V); C positions per chunk, N whole chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from bd_core import ViewLayout

from ._model import head_logits
from ._sharding import zeros_placed_like
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


def sum_logits(model: Any, layout: ViewLayout, fn: Callable[..., tuple[Any, Any]], weights: Any, *per_position: Any,
               whole: tuple[Any, ...] = (), chunk: int | None = None) -> tuple[jax.Array, Any, Any]:
    """`(Σ weights · term, term, aux)` for `term, aux = fn(logits_BxTxV, *per_position, *whole)`: a
    loss that is a weighted sum over positions of a per-position term of the logits (SFT's
    cross-entropy, OPD's divergence), `term` `[B, T]` and `aux` (any pytree of `[B, T, ...]` arrays)
    as `fn` gives them, without gradient. `weights` `[B, T]` carry no gradient either, nor do
    `whole`'s arrays, which `fn` gets whole with every chunk (a teacher's head).

    With the model's `logits_chunk` C > 0 (default; 0 is the reference, `fn` of the whole logits
    under plain autodiff) it runs C positions of every row at a time and, because the sum is linear
    in each term, takes the sum's gradient with respect to the final hidden states and the LM head
    in the same pass (a `jax.custom_vjp`; the backward pass scales them by the sum's cotangent).
    The backward pass then neither recomputes the logits nor reads `per_position` or `whole` again
    (OPD's teacher outputs die with the forward), and the head's matmuls run three times per chunk
    instead of `map_logits`' four. A head that is not differentiated (frozen under LoRA) gets no gradient
    computed. Needs a `BlockDiffusionLM` (`features`, `head_weight`)."""
    chunk = logits_chunk(model) if chunk is None else int(chunk)
    weights = jnp.asarray(weights, jnp.float32)
    whole = tuple(lax.stop_gradient(jnp.asarray(a)) for a in whole)
    if chunk <= 0 or chunk >= layout.tokens.shape[1]:
        term, aux = fn(model(layout), *per_position, *whole)
        return jnp.sum(weights * term), lax.stop_gradient(term), lax.stop_gradient(aux)
    head = functools.partial(head_logits, tied=model.lm_head is None, dtype=model.config.compute_jnp_dtype)
    total, term, aux = _fused_sum(fn, head, chunk)(model.features(layout), model.head_weight, weights,
                                                   tuple(jnp.asarray(a) for a in per_position), whole)
    return total, lax.stop_gradient(term), lax.stop_gradient(aux)


def _fused_sum(fn: Callable[..., tuple[Any, Any]], head: Callable[..., Any], chunk: int) -> Callable[..., Any]:
    """`(h, weight, weights, xs, whole) -> (total, term, aux)` chunk by chunk, whose forward pass
    under differentiation also returns the gradient of `total` (see `sum_logits`)."""

    def chunks(h, weight, w, xs, whole, wrt: tuple[int, ...]):
        """(total, term, aux, dh, dweight): the gradients (None where not in `wrt`) of every chunk."""
        def piece(h_BxCxD, weight, w_BxC, xs):
            term, aux = fn(head(h_BxCxD, weight), *xs, *whole)
            return jnp.sum(w_BxC * term), (term, aux)

        length = h.shape[1]
        count, rest = divmod(length, chunk)
        grad = jax.value_and_grad(piece, argnums=wrt, has_aux=True) if wrt else None

        def run(start, size, carry):
            total, dh, dweight = carry
            cut = lambda a: lax.dynamic_slice_in_dim(a, start, size, axis=1)  # noqa: E731
            args = (cut(h), weight, cut(w), jax.tree.map(cut, xs))
            if grad is None:
                value, out = piece(*args)
                return (total + value, dh, dweight), out
            (value, out), grads = grad(*args)
            grads = dict(zip(wrt, grads))
            if 0 in wrt:
                dh = lax.dynamic_update_slice_in_dim(dh, grads[0].astype(dh.dtype), start, axis=1)
            if 1 in wrt:
                dweight = dweight + grads[1].astype(jnp.float32)
            return (total + value, dh, dweight), out

        # Every position's dh is written once, so the buffer may start as any array of h's shape:
        # h itself gives it h's placement (a constant would be held whole on every device), and
        # the same for the head's float32 sum.
        carry = (jnp.zeros((), jnp.float32), h if 0 in wrt else None, zeros_placed_like(weight) if 1 in wrt else None)
        carry, out = lax.scan(lambda c, i: run(i * chunk, chunk, c), carry, jnp.arange(count, dtype=jnp.int32),
                              unroll=unrolled())
        out = jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape((y.shape[1], count * chunk) + y.shape[3:]), out)
        if rest:
            carry, tail = run(count * chunk, rest, carry)
            out = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out, tail)
        total, dh, dweight = carry
        return total, out[0], out[1], dh, None if dweight is None else dweight.astype(weight.dtype)

    @jax.custom_vjp
    def fused(h, weight, w, xs, whole):
        total, term, aux, _, _ = chunks(h, weight, w, xs, whole, ())
        return total, term, aux

    def fused_fwd(h, weight, w, xs, whole):
        wrt = tuple(i for i, x in enumerate((h, weight)) if x.perturbed)
        value = lambda tree: jax.tree.map(lambda x: x.value, tree)  # noqa: E731
        total, term, aux, dh, dweight = chunks(h.value, weight.value, value(w), value(xs), value(whole), wrt)
        return (total, term, aux), (dh, dweight)

    def fused_bwd(grads, cotangents):
        g = cotangents[0]
        if isinstance(g, SymbolicZero):
            return None, None, None, None, None
        scale = lambda d: None if d is None else (d * g).astype(d.dtype)  # noqa: E731
        return scale(grads[0]), scale(grads[1]), None, None, None

    fused.defvjp(fused_fwd, fused_bwd, symbolic_zeros=True)
    return fused
