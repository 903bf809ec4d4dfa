"""The sampling distribution, shared by the sampler and by trace scoring.

`sampling_logprobs` applies temperature -> top-k -> top-p and bans ids; both the sampler and the
replay scorer call it, which is what makes recorded and replayed log-probs agree. Also the
confidence rules and the entropy of that distribution. Legend: B batch, N positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

NEG_INF = -jnp.inf


def sampling_logprobs(
    logits: Float[Array, "*batch vocab"],
    *,
    temperature: float | int | Float[Array, ""],
    top_k: int | Int[Array, ""] | None = None,
    top_p: float | int | Float[Array, ""] | None = None,
    banned_ids: Sequence[int] = (),
) -> Float[Array, "*batch vocab"]:
    """Float32 log-probs of the distribution actually sampled; excluded ids are -inf.

    Banned ids go first so that top-k and top-p only ever keep samplable ids. Ties at the top-k or
    top-p boundary keep every tied id (a deterministic rule, so sampler and replay agree).
    `temperature`, `top_k` and `top_p` may be traced scalars (the sampler passes them so, and
    compiles once for all values); `None` turns a filter off and the Python number 0 is greedy:
    log-prob 0 on the first argmax, -inf elsewhere.
    """
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    if banned_ids:
        banned = jnp.zeros((vocab,), bool).at[jnp.asarray(tuple(banned_ids), jnp.int32)].set(True)
        x = jnp.where(banned, NEG_INF, x)
    if isinstance(temperature, (int, float)) and temperature == 0:
        best = jnp.argmax(x, axis=-1)
        return jnp.where(jnp.arange(vocab) == best[..., None], 0.0, NEG_INF).astype(jnp.float32)
    x = x / jnp.asarray(temperature, jnp.float32)
    if top_k is not None:
        # a sort, not lax.top_k, so that k may be traced; the k-th value is exact either way
        k = jnp.clip(jnp.asarray(top_k, jnp.int32), 1, vocab)
        kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), jnp.broadcast_to(k - 1, x.shape[:-1])[..., None], axis=-1)
        x = jnp.where(x >= kth, x, NEG_INF)
    logp = jax.nn.log_softmax(x, axis=-1)
    if top_p is not None:
        probs = jnp.exp(logp)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p: an id is in it iff the mass strictly
        # before it is < top_p; the top id always is. top_p >= 1 keeps all (cumsum may round below 1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        top_p = jnp.asarray(top_p, jnp.float32)
        kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
        floor = jnp.take_along_axis(sorted_probs, kept - 1, axis=-1)
        logp = jax.nn.log_softmax(jnp.where((probs >= floor) | (top_p >= 1), logp, NEG_INF), axis=-1)
    return logp


def token_logprob(logp: Float[Array, "*batch vocab"], tokens: Int[Array, "*batch"]) -> Float[Array, "*batch"]:
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy(logp: Float[Array, "*batch vocab"]) -> Float[Array, "*batch"]:
    """Entropy of a distribution given by log-probs; excluded (-inf) ids contribute 0."""
    finite = jnp.isfinite(logp)
    return -jnp.sum(jnp.where(finite, jnp.exp(logp) * jnp.where(finite, logp, 0.0), 0.0), axis=-1)


def confidence(logp: Float[Array, "*batch vocab"], tokens: Int[Array, "*batch"], rule: str) -> Float[Array, "*batch"]:
    """How sure the sampler is of a position, in [0, 1] for every rule (so one threshold scale)."""
    if rule == "probability":
        return jnp.exp(token_logprob(logp, tokens))
    if rule == "margin":
        top2 = jnp.exp(jax.lax.top_k(logp, 2)[0])
        return top2[..., 0] - top2[..., 1]
    if rule == "entropy":
        return jnp.exp(-entropy(logp))
    raise ValueError(f"confidence rule: expected 'probability', 'margin' or 'entropy', got {rule!r}")
