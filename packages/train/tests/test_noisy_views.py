"""Several noisy views of one clean sequence (`CorruptionConfig.views`): the attention rule keeps
the views apart, so each view's logits are those of its own one-view layout and a K-view SFT batch's
loss sums the K one-view batches' numerators and denominators, with the clean stream run once."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

from bd_core import DiffusionTokenBatch, ViewLayout
from bd_data import ByteTokenizer, CanvasConfig, CorruptionConfig, get_task, sft_dataset
from bd_models import BlockDiffusionLM, ModelConfig
from bd_train import sft_loss

TOK = ByteTokenizer()
CANVAS = CanvasConfig(prompt_len=8, max_new_tokens=12, block_size=4)
VIEWS = 3


def _one_view(batch: DiffusionTokenBatch, k: int) -> DiffusionTokenBatch:
    """The clean stream and noisy view k (1-based) of a K-view batch, as a one-view batch."""
    c, n = CANVAS.prompt_len + CANVAS.max_new_tokens, CANVAS.max_new_tokens
    cols = np.r_[0:c, c + (k - 1) * n:c + k * n]
    take = lambda x: np.asarray(x)[:, cols]  # noqa: E731
    layout = batch.layout
    view_ids = np.minimum(take(layout.view_ids), 1)
    return DiffusionTokenBatch.create(
        ViewLayout.create(take(layout.tokens), take(layout.positions), take(layout.block_ids), view_ids,
                          take(layout.valid)),
        take(batch.targets), take(batch.weights), take(batch.denom_weights))


@pytest.mark.parametrize("attention, weighting", [("dense", "none"), ("blocked", "elbo")])
def test_each_view_is_its_own_one_view_layout(attention, weighting):
    corruption = CorruptionConfig(weighting=weighting, views=VIEWS)
    examples = get_task("argsort", length=5).dataset("train")
    batch = sft_dataset(examples, TOK, CANVAS, corruption, seed=0, batch_size=4, shard_index=0, shard_count=1)[0]
    c, n = CANVAS.prompt_len + CANVAS.max_new_tokens, CANVAS.max_new_tokens
    assert batch.shape == (4, c + VIEWS * n)
    # Tiles of 8 that straddle views and blocks: the tile plan must skip and mask across views exactly.
    config = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                         block_size=CANVAS.block_size, attention=attention, q_tile=8, k_tile=8)
    forward = eqx.filter_jit(BlockDiffusionLM.__call__)
    model = BlockDiffusionLM(config, key=jax.random.key(0))
    logits = np.asarray(forward(model, batch.layout))
    whole = sft_loss(forward(model, batch.layout), batch).loss
    numerator = denominator = 0.0
    for k in range(1, VIEWS + 1):
        single = _one_view(batch, k)
        single_logits = forward(model, single.layout)
        own = np.asarray(single_logits)
        np.testing.assert_allclose(logits[:, c + (k - 1) * n:c + k * n], own[:, c:], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits[:, :c], own[:, :c], rtol=1e-5, atol=1e-5)
        part = sft_loss(single_logits, single).loss
        numerator, denominator = numerator + float(part.numerator), denominator + float(part.denominator)
    np.testing.assert_allclose(float(whole.numerator), numerator, rtol=1e-5)
    np.testing.assert_allclose(float(whole.denominator), denominator, rtol=1e-6)
    # The views are distinct corruptions, not copies: the loss is not K times one view's.
    views = [batch.layout.tokens[:, c + k * n:c + (k + 1) * n] for k in range(VIEWS)]
    assert not all(np.array_equal(views[0], v) for v in views[1:])

