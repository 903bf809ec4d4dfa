"""The sampling distribution, shared by the sampler and by trace scoring.

`SamplingDistribution` applies bans -> temperature -> top-k -> top-p (`sampling_logprobs`); the
sampler samples from it and `token_logprobs` replays traces under it, which is what makes recorded
and replayed log-probs agree. Also the confidence rules (scored under `unfiltered()`, the model's
own distribution) and the entropy of that distribution.
Shape letters: see bd_core (`*batch` any leading axes, V vocab).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from bd_core import config_error

NEG_INF = -jnp.inf
MIN_TEMPERATURE = 1e-6  # logits / temperature must stay finite in float32
OWNER = "SamplingDistribution"


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


class SamplingDistribution(eqx.Module):
    """Logits with `banned_ids` excluded, divided by `temperature` (0 = greedy: the first argmax),
    then the `top_k` largest, then the smallest set with mass >= `top_p`, renormalized; `None`
    turns a filter off.

    The numeric settings are 0-d array leaves, so `eqx.filter_jit` traces them and one compile
    serves every value; whether a filter is on, greedy decoding and the banned ids are structure.
    The leaves hold the values as given (float64/int64 numpy), so `to_dict` (and the fingerprints
    built from it) read back exactly what was configured; every computation casts them to
    float32/int32, and under jit they arrive as float32/int32.

    Attributes:
        temperature: divides the logits (0: greedy).
        top_k: keep the k most likely tokens (None: off).
        top_p: keep the smallest set with this mass (None: off).
        greedy: whether the temperature is 0 (structure, static).
        banned_ids: tokens never sampled (static).
    """

    temperature: Float[Array | np.ndarray, ""]
    top_k: Int[Array | np.ndarray, ""] | None
    top_p: Float[Array | np.ndarray, ""] | None
    greedy: bool = eqx.field(static=True)
    banned_ids: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, temperature: float | int = 1.0, top_k: int | None = None, top_p: float | int | None = None,
                 banned_ids: Sequence[int] = ()):
        if not _is_number(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
            tiny = _is_number(temperature) and 0 < temperature < MIN_TEMPERATURE
            raise config_error(OWNER, "temperature", temperature, f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}",
                               "a smaller one overflows float32 logits / temperature into NaN log-probs; use 0 for "
                               "greedy" if tiny else None)
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise config_error(OWNER, "top_k", top_k, "an int >= 1, or None to disable")
        if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
            raise config_error(OWNER, "top_p", top_p, "a number in (0, 1], or None to disable")
        try:
            ids = tuple(banned_ids)
        except TypeError:
            raise config_error(OWNER, "banned_ids", banned_ids, "a sequence of token ids") from None
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                raise config_error(OWNER, "banned_ids", ids, "token ids >= 0", f"drop {token!r}")
        self.temperature = np.asarray(temperature, np.float64)
        self.top_k = None if top_k is None else np.asarray(top_k, np.int64)
        self.top_p = None if top_p is None else np.asarray(top_p, np.float64)
        self.greedy = temperature == 0
        self.banned_ids = tuple(sorted({int(token) for token in ids}))

    def _with(self, **changes: Any) -> SamplingDistribution:
        """A copy with some fields replaced, without revalidating (the leaves may be traced)."""
        out = object.__new__(SamplingDistribution)
        for name in ("temperature", "top_k", "top_p", "greedy", "banned_ids"):
            object.__setattr__(out, name, changes.get(name, getattr(self, name)))
        return out

    def logprobs(self, logits: Float[Array, "*batch V"]) -> Float[Array, "*batch V"]:
        """Float32 log-probs of the distribution; excluded ids are -inf (see `sampling_logprobs`)."""
        return sampling_logprobs(logits, temperature=0 if self.greedy else self.temperature, top_k=self.top_k,
                                 top_p=self.top_p, banned_ids=self.banned_ids)

    def unfiltered(self) -> SamplingDistribution:
        """The model's own distribution: the same bans, at temperature 1, without top-k or top-p.
        The sampler scores confidence under it, so no sampling knob changes which tokens commit."""
        return self._with(temperature=jnp.float32(1.0), top_k=None, top_p=None, greedy=False)

    def without_filters(self) -> SamplingDistribution:
        """The same temperature and bans without top-k or top-p: every token the sampler could ever
        emit keeps a finite log-prob. A KL between two models is taken under it (GRPO's to its
        reference): under the filtered distributions, a token one model keeps and the other drops
        has an infinite log-ratio."""
        return self._with(top_k=None, top_p=None)

    def with_banned(self, ids: Sequence[int]) -> SamplingDistribution:
        """The same distribution with `ids` banned too."""
        return self._with(banned_ids=tuple(sorted(set(self.banned_ids) | {int(token) for token in ids})))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (outside jit): temperature, top_k, top_p, banned_ids."""
        return {"temperature": float(self.temperature),
                "top_k": None if self.top_k is None else int(self.top_k),
                "top_p": None if self.top_p is None else float(self.top_p),
                "banned_ids": list(self.banned_ids)}

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))


def sampling_logprobs(
    logits: Float[Array, "*batch V"],
    *,
    temperature: float | int | Float[ArrayLike, ""],
    top_k: int | Int[ArrayLike, ""] | None = None,
    top_p: float | int | Float[ArrayLike, ""] | None = None,
    banned_ids: Sequence[int] = (),
) -> Float[Array, "*batch V"]:
    """Float32 log-probs of the distribution actually sampled; excluded ids are -inf.

    Banned ids go first so that top-k and top-p only ever keep samplable ids. Ties at the top-k or
    top-p boundary keep every tied id (a deterministic rule, so sampler and replay agree).
    `temperature`, `top_k` and `top_p` may be traced scalars (compiled once for all values);
    `None` turns a filter off and the Python number 0 is greedy: log-prob 0 on the first argmax,
    -inf elsewhere.
    """
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    if banned_ids:
        banned = jnp.zeros((vocab,), bool).at[jnp.asarray(tuple(banned_ids), jnp.int32)].set(True)
        x = jnp.where(banned, NEG_INF, x)
    if isinstance(temperature, (int, float)) and temperature == 0:
        best = first_argmax(x)
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


def first_argmax(x: Float[Array, "*batch V"]) -> Int[Array, "*batch"]:
    """`jnp.argmax` over the last axis (the first maximum; the first NaN where there is one), as a
    max and then a min over the indices that reach it. XLA:CPU runs argmax's paired (value, index)
    reduction element by element, and inside a sampling loop it fuses the whole Gumbel transform
    (two logs per entry) into it; two plain reductions vectorize (BENCHMARKS.md, sampler)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def gumbel_max(key: PRNGKeyArray, logp: Float[Array, "*batch V"]) -> Int[Array, "*batch"]:
    """A draw from `softmax(logp)`: exactly `jax.random.categorical(key, logp)` (the same Gumbel
    noise and the same first argmax), computed with `first_argmax`."""
    return first_argmax(jax.random.gumbel(key, logp.shape, logp.dtype) + logp)


def token_logprob(logp: Float[Array, "*batch V"], tokens: Int[Array, "*batch"]) -> Float[Array, "*batch"]:
    """The log-probability of each token under the log-probabilities `logp` over the vocabulary
    (NaN for an id outside it). Picked by comparing the vocabulary's indices with the token and
    summing: one entry plus zeros, so exactly the entry, in one fused reduction; a gather along a
    vocabulary split over chips left XLA holding int32 index arrays of the logits' size."""
    tokens = jnp.asarray(tokens, jnp.int32)[..., None]
    index = jax.lax.broadcasted_iota(jnp.int32, logp.shape, logp.ndim - 1)
    picked = jnp.sum(jnp.where(index == tokens, logp, jnp.zeros((), logp.dtype)), axis=-1)
    inside = (tokens[..., 0] >= 0) & (tokens[..., 0] < logp.shape[-1])
    return jnp.where(inside, picked, jnp.nan)


def entropy(logp: Float[Array, "*batch V"]) -> Float[Array, "*batch"]:
    """Entropy of a distribution given by log-probs; excluded (-inf) ids contribute 0."""
    finite = jnp.isfinite(logp)
    return -jnp.sum(jnp.where(finite, jnp.exp(logp) * jnp.where(finite, logp, 0.0), 0.0), axis=-1)


def confidence(logp: Float[Array, "*batch V"], tokens: Int[Array, "*batch"], rule: str) -> Float[Array, "*batch"]:
    """How sure the sampler is of a position, in [0, 1] for every rule (so one threshold scale)."""
    if rule == "probability":
        return jnp.exp(token_logprob(logp, tokens))
    if rule == "margin":
        top2 = jnp.exp(jax.lax.top_k(logp, 2)[0])
        return top2[..., 0] - top2[..., 1]
    if rule == "entropy":
        return jnp.exp(-entropy(logp))
    raise ValueError(f"confidence rule: expected 'probability', 'margin' or 'entropy', got {rule!r}")
