"""Canvas and SFT-layout invariants on random examples (hypothesis)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bd_core import ConfigError, attention_allowed
from bd_data import (
    ByteTokenizer,
    Canvas,
    CanvasConfig,
    CanvasOverflow,
    CorruptionConfig,
    build_canvas,
    corrupt,
    fit_to_canvas,
    prompt_canvas,
)

TOK = ByteTokenizer()


@st.composite
def canvases(draw):
    b = draw(st.sampled_from([1, 2, 4, 8]))
    config = CanvasConfig(prompt_len=b * draw(st.integers(1, 4)), max_new_tokens=b * draw(st.integers(1, 4)),
                          block_size=b, policy=draw(st.sampled_from(["block_aligned", "contiguous"])))
    rows = draw(st.integers(1, 4))
    ids = st.integers(0, 255)
    examples = [(draw(st.lists(ids, max_size=config.prompt_len)),
                 draw(st.lists(ids, max_size=config.max_new_tokens - 1))) for _ in range(rows)]
    corruption = CorruptionConfig(t_min=draw(st.sampled_from([0.05, 0.5])), t_max=1.0,
                                  schedule=draw(st.sampled_from(["linear", "cosine"])),
                                  weighting=draw(st.sampled_from(["elbo", "none"])), stratified=draw(st.booleans()))
    return config, examples, corruption, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(canvases())
def test_canvas_invariants(case):
    config, examples, _, _ = case
    p, n, b = config.prompt_len, config.max_new_tokens, config.block_size
    for prompt, answer in examples:
        c = build_canvas(prompt, answer, config, TOK)
        assert c.tokens.shape == c.valid.shape == (p + n,)
        # Left-padded prompt: invalid pad, then the prompt, ending at slot P (a block boundary).
        assert p % b == 0
        assert np.array_equal(c.tokens[p - len(prompt):p], prompt) and c.valid[p - len(prompt):p].all()
        assert not c.valid[:p - len(prompt)].any() and (c.tokens[:p - len(prompt)] == TOK.pad_id).all()
        # answer + eos, eos-filled to the end of its last block; invalid pad after.
        end = p + -(-(len(answer) + 1) // b) * b
        assert np.array_equal(c.tokens[p:p + len(answer)], answer)
        assert (c.tokens[p + len(answer):end] == TOK.eos_id).all() and end - p - len(answer) >= 1
        assert c.valid[p:end].all() and not c.valid[end:].any() and (c.tokens[end:] == TOK.pad_id).all()
        assert np.array_equal(c.block_ids, np.arange(p + n) // b)
        if config.policy == "block_aligned":
            assert np.array_equal(c.positions, np.arange(p + n))
        else:  # positions run 0, 1, ... over the valid prompt and straight on into the completion
            assert np.array_equal(c.positions[c.valid], np.arange(int(c.valid.sum())))
        tokens, valid, positions = prompt_canvas(prompt, config, TOK)
        assert np.array_equal(tokens, c.tokens[:p]) and np.array_equal(valid, c.valid[:p])
        assert np.array_equal(positions, c.positions)


@settings(max_examples=150, deadline=None)
@given(canvases())
def test_sft_layout_invariants(case):
    config, examples, corruption, seed = case
    p, n, b = config.prompt_len, config.max_new_tokens, config.block_size
    built = [build_canvas(pr, an, config, TOK) for pr, an in examples]
    stack = Canvas(*(np.stack([getattr(c, f) for c in built]) for f in ("tokens", "valid", "positions", "block_ids")))
    batch = corrupt(stack, config, corruption, mask_id=TOK.mask_id, rng=np.random.default_rng(seed))
    lay = batch.layout
    assert lay.shape == (len(examples), p + 2 * n)
    assert all(isinstance(x, np.ndarray) for x in (lay.tokens, batch.targets, batch.weights, batch.denom_weights))
    clean, noisy = slice(0, p + n), slice(p + n, p + 2 * n)
    assert np.array_equal(lay.tokens[:, clean], stack.tokens) and (lay.view_ids[:, clean] == 0).all()
    assert (lay.view_ids[:, noisy] == 1).all()
    assert np.array_equal(lay.positions[:, noisy], stack.positions[:, p:])
    assert np.array_equal(lay.block_ids[:, noisy], stack.block_ids[:, p:])
    assert np.array_equal(lay.valid[:, noisy], stack.valid[:, p:])
    comp_valid = stack.valid[:, p:]
    masked = lay.tokens[:, noisy] == TOK.mask_id
    # Only valid completion tokens are corrupted; the rest of the noisy copy is the clean completion.
    assert not (masked & ~comp_valid).any()
    assert np.array_equal(np.where(masked, stack.tokens[:, p:], lay.tokens[:, noisy]), stack.tokens[:, p:])
    # Prompt and clean stream are never supervised; targets are the clean tokens, 0 elsewhere.
    assert (batch.weights[:, clean] == 0).all() and (batch.denom_weights[:, clean] == 0).all()
    assert (batch.targets[:, clean] == 0).all()
    assert np.array_equal(batch.targets[:, noisy], np.where(comp_valid, stack.tokens[:, p:], 0))
    assert np.array_equal(batch.weights[:, noisy] > 0, masked)
    assert not (batch.weights > 0)[~lay.valid].any()
    expected_denom = comp_valid if corruption.weighting == "elbo" else masked
    assert np.array_equal(batch.denom_weights[:, noisy], expected_denom.astype(np.float32))
    if corruption.weighting == "none":
        assert set(np.unique(batch.weights)) <= {0.0, 1.0}
    # At least one mask in every valid completion block; one weight per block.
    blocks_valid = comp_valid.reshape(len(examples), n // b, b).any(-1)
    assert np.array_equal(masked.reshape(len(examples), n // b, b).any(-1), blocks_valid)
    w = batch.weights[:, noisy].reshape(len(examples), n // b, b)
    assert all(len(np.unique(blk[blk > 0])) <= 1 for blk in w.reshape(-1, b))
    # Under the attention rule a noisy token sees every valid prompt token (earlier clean blocks).
    allowed = np.asarray(attention_allowed(lay))
    for row in range(len(examples)):
        for q in np.flatnonzero(lay.valid[row, noisy]) + p + n:
            assert allowed[row, q, :p][lay.valid[row, :p]].all()
            assert not allowed[row, q, p:p + n][lay.block_ids[row, p:p + n] >= lay.block_ids[row, q]].any()


def test_overflow_and_policies():
    config = CanvasConfig(prompt_len=4, max_new_tokens=4, block_size=2)
    with pytest.raises(CanvasOverflow, match=r"prompt has 5 tokens but CanvasConfig.prompt_len=4"):
        build_canvas(list(range(5)), [1], config, TOK)
    with pytest.raises(CanvasOverflow, match=r"needs 5 tokens \(answer 4 \+ eos\).*max_new_tokens=4"):
        build_canvas([1], list(range(4)), config, TOK)
    prompt, answer, truncated = fit_to_canvas(list(range(6)), list(range(10, 16)), config, "truncate")
    assert truncated and list(prompt) == [2, 3, 4, 5] and list(answer) == [10, 11, 12]
    assert fit_to_canvas(list(range(6)), [1], config, "skip") is None
    assert fit_to_canvas([1], [1], config, "skip")[2] is False


def test_config_errors_name_field_and_fix():
    with pytest.raises(ConfigError, match=r"CanvasConfig.prompt_len: expected a multiple of block_size=4, got 6; "
                                          r"round it up to 8"):
        CanvasConfig(prompt_len=6, max_new_tokens=8, block_size=4)
    with pytest.raises(ConfigError, match=r"CanvasConfig.policy"):
        CanvasConfig(policy="packed")
    with pytest.raises(ConfigError, match=r"CanvasConfig.block_size: expected a positive int"):
        CanvasConfig(block_size=0)
    with pytest.raises(ConfigError, match=r"CorruptionConfig.t_min: expected 0 < t_min <= t_max <= 1.*got 0.0"):
        CorruptionConfig(t_min=0.0)
    with pytest.raises(ConfigError, match=r"CorruptionConfig.t_max: expected 0 < t_min <= t_max <= 1.*got 0.2"):
        CorruptionConfig(t_min=0.5, t_max=0.2)
    with pytest.raises(ConfigError, match=r"CorruptionConfig.weighting"):
        CorruptionConfig(weighting="1/t")
