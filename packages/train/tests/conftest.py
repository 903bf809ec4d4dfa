"""Shared fixtures for bd_train tests: a tiny token model and random diffusion batches."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bd_core import DiffusionTokenBatch, ViewLayout
from bd_train import sft_objective

VOCAB = 11


class ToyLM(eqx.Module):
    """Embeddings -> 2-layer MLP -> vocabulary logits, plus a pooled context term so positions
    interact; enough to exercise accumulation and checkpoints without the real decoder."""

    embed: jax.Array
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear
    mix: jax.Array

    def __init__(self, vocab: int = VOCAB, width: int = 8, *, key: jax.Array, dtype=jnp.float32):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = jax.random.normal(k1, (vocab, width), dtype)
        self.hidden = eqx.nn.Linear(width, width, key=k2, dtype=dtype)
        self.out = eqx.nn.Linear(width, vocab, key=k3, dtype=dtype)
        self.mix = 0.1 * jax.random.normal(k4, (width,), dtype)

    def __call__(self, layout: ViewLayout) -> jax.Array:
        x = self.embed[layout.tokens]
        valid = layout.valid[..., None].astype(x.dtype)
        pooled = jnp.sum(x * valid, axis=1, keepdims=True) / jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1)
        h = jax.nn.tanh(jax.vmap(jax.vmap(self.hidden))(x + pooled * self.mix))
        return jax.vmap(jax.vmap(self.out))(h).astype(jnp.float32)


def make_batch(seed: int, rows: int = 8, length: int = 6, *, fractional: bool = True) -> DiffusionTokenBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (rows, length))
    valid = rng.random((rows, length)) < 0.85
    active = valid & (rng.random((rows, length)) < 0.6)
    weights = np.where(active, rng.uniform(0.2, 3.0, (rows, length)) if fractional else 1.0, 0.0)
    targets = np.where(active, rng.integers(0, VOCAB, (rows, length)), 0)
    positions = np.tile(np.arange(length), (rows, 1))
    layout = ViewLayout.create(tokens, positions, positions // 2, np.zeros_like(tokens), valid)
    return DiffusionTokenBatch.create(layout, targets, weights.astype(np.float32), active.astype(np.float32))


@pytest.fixture
def toy_model():
    return ToyLM


@pytest.fixture
def batch_factory():
    return make_batch


class Gradients:
    """Training paths compared by their gradients, against SFT's on the whole batch."""

    @staticmethod
    def probe() -> optax.GradientTransformation:
        """An 'optimizer' whose state is the last normalized gradient it was given (and that leaves
        the parameters alone): Adam's per-coordinate normalization would hide a gradient's error
        up to a constant scale."""
        return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                            lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads),
                                                                               grads))

    @staticmethod
    def relative_error(a, b) -> float:
        diff = optax.tree.norm(jax.tree.map(lambda x, y: x - y, a, b))
        return float(diff / optax.tree.norm(b))

    @staticmethod
    def reference(model, batch):
        """SFT's gradient on the whole batch in one call: the reference every path must equal."""
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jax.grad(lambda p: sft_objective(eqx.combine(p, static), batch).loss.compute())(params)


@pytest.fixture
def gradients():
    return Gradients
