"""Corruption statistics: mask rate vs t, the at-least-one rule and its bias, estimator means."""

import numpy as np
import pytest

from bd_data import DEFAULT_CORRUPTION, ByteTokenizer, CanvasConfig, CorruptionConfig, build_canvas, corrupt, sample_t

TOK = ByteTokenizer()


def _full_batch(rows, n, b):
    """Canvases whose completion fills all N slots (every block valid), prompt of 4 tokens."""
    config = CanvasConfig(prompt_len=max(4, b), max_new_tokens=n, block_size=b)
    canvas = build_canvas([1, 2, 3, 4], [7] * (n - 1), config, TOK)
    return config, type(canvas)(*(np.broadcast_to(x, (rows, *x.shape)).copy() for x in
                                  (canvas.tokens, canvas.valid, canvas.positions, canvas.block_ids)))


def _noisy(batch, config):
    start = config.prompt_len + config.max_new_tokens
    return batch.layout.tokens[:, start:] == TOK.mask_id, batch.weights[:, start:], batch.denom_weights[:, start:]


def _with_forced(rate, b):
    """Expected masked fraction of a b-token block at mask rate p with at least one mask."""
    return rate + (1 - rate) ** b / b


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("t", [0.15, 0.5, 0.9])
def test_mask_rate_matches_schedule(schedule, t):
    b, rows = 4, 4000
    config, canvas = _full_batch(rows, 8, b)
    cfg = CorruptionConfig(t_min=t, t_max=t, schedule=schedule)
    masked, _, _ = _noisy(corrupt(canvas, config, cfg, mask_id=TOK.mask_id, rng=np.random.default_rng(0)), config)
    rate = t if schedule == "linear" else 1 - np.cos(np.pi * t / 2)
    expected = _with_forced(rate, b)
    stderr = np.sqrt(expected * (1 - expected) / masked.size)
    assert abs(masked.mean() - expected) < 5 * stderr
    assert masked.reshape(rows, -1, b).any(-1).all()


def test_per_block_mask_rate_follows_its_t():
    # Under linear elbo weighting each masked token carries 1/t of its block, which reveals t.
    b, rows = 4, 20000
    config, canvas = _full_batch(rows, 8, b)
    cfg = CorruptionConfig(t_min=0.1, t_max=1.0, weighting="elbo")
    masked, weights, _ = _noisy(corrupt(canvas, config, cfg, mask_id=TOK.mask_id, rng=np.random.default_rng(1)), config)
    t = 1.0 / weights.reshape(-1, b).max(-1)
    frac = masked.reshape(-1, b).mean(-1)
    assert t.min() >= 0.1 - 1e-6 and t.max() <= 1.0 + 1e-6
    counts, _ = np.histogram(t, bins=9, range=(0.1, 1.0))  # uniform t: each bin ~ K/9
    assert np.abs(counts - t.size / 9).max() < 5 * np.sqrt(t.size / 9)
    for lo in np.arange(0.1, 1.0, 0.1):
        sel = (t >= lo) & (t < lo + 0.1)
        expected = np.mean(_with_forced(t[sel], b))
        assert abs(frac[sel].mean() - expected) < 5 * np.sqrt(0.25 / (sel.sum() * b))


def test_stratified_t_hits_every_stratum_once():
    block_valid = np.ones((16, 3), bool)
    block_valid[3, 1:] = False
    cfg = CorruptionConfig(t_min=0.2, t_max=0.8, stratified=True)
    t = sample_t(block_valid, cfg, np.random.default_rng(0))
    k = int(block_valid.sum())
    strata = np.floor((t[block_valid] - 0.2) / 0.6 * k).astype(int)
    assert sorted(strata) == list(range(k))


def _bias_factor(t_min, t_max, n):
    """1 + E_t[(1 - t)^n / (n t)] for t ~ U[t_min, t_max] (the at-least-one rule, linear elbo)."""
    t = np.linspace(t_min, t_max, 2_000_001)
    return 1 + np.trapezoid((1 - t) ** n / (n * t), t) / (t_max - t_min)


@pytest.mark.parametrize("t_range", [(0.1, 1.0), (0.3, 0.8), (1e-3, 1.0)])
def test_elbo_constant_loss_estimate_and_at_least_one_bias(t_range):
    b, rows, c = 4, 25000, 2.5
    config, canvas = _full_batch(rows, 16, b)
    cfg = CorruptionConfig(t_min=t_range[0], t_max=t_range[1], weighting="elbo")
    _, weights, denom = _noisy(corrupt(canvas, config, cfg, mask_id=TOK.mask_id, rng=np.random.default_rng(2)), config)
    per_block = (c * weights.astype(np.float64)).reshape(-1, b).sum(-1) / b  # each block's share of the loss
    estimate = (c * weights.astype(np.float64)).sum() / denom.sum()
    stderr = per_block.std() / np.sqrt(per_block.size)
    expected = c * _bias_factor(*t_range, b)
    assert abs(estimate - expected) < 5 * stderr
    assert abs(estimate - c) > 5 * stderr  # the bias is real for small blocks...
    # ...and corrupt's docstring states the factor it measures.
    doc = corrupt.__doc__.replace("\n", " ")
    stated = {(0.1, 1.0): "1.164", (0.3, 0.8): "1.042", (1e-3, 1.0): "2.21"}[t_range]
    assert stated in doc and abs(float(stated) - _bias_factor(*t_range, b)) < 6e-3


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_elbo_estimate_with_large_blocks(schedule):
    # With 64-token blocks the forced mask is negligible on t >= 0.2, so the estimate is
    # c * E_t[-alpha'(t)] = c * (alpha(t_min) - alpha(t_max)) / (t_max - t_min): c for linear.
    rows, c, t_min, t_max = 3000, 1.7, 0.2, 1.0
    config, canvas = _full_batch(rows, 64, 64)
    cfg = CorruptionConfig(t_min=t_min, t_max=t_max, weighting="elbo", schedule=schedule)
    _, weights, denom = _noisy(corrupt(canvas, config, cfg, mask_id=TOK.mask_id, rng=np.random.default_rng(3)), config)
    per_row = c * weights.astype(np.float64).sum(-1) / denom.sum(-1)
    alpha = lambda t: 1 - cfg.mask_rate(t)  # noqa: E731
    expected = c * (alpha(t_min) - alpha(t_max)) / (t_max - t_min)
    if schedule == "linear":
        assert np.isclose(expected, c)
    assert abs(per_row.mean() - expected) < 5 * per_row.std() / np.sqrt(rows)


def test_none_weighting_is_exactly_the_constant():
    config, canvas = _full_batch(64, 8, 4)
    for seed in range(5):
        batch = corrupt(canvas, config, CorruptionConfig(), mask_id=TOK.mask_id, rng=np.random.default_rng(seed))
        _, weights, denom = _noisy(batch, config)
        assert np.isclose((3.0 * weights).sum() / denom.sum(), 3.0, rtol=1e-6)


def test_default_is_the_measured_choice():
    # Plain mean CE over masked tokens on a clipped t range (ENVIRONMENT.md), and the config default.
    default = DEFAULT_CORRUPTION
    assert default == CorruptionConfig()
    assert (default.weighting, default.t_min, default.t_max) == ("none", 0.1, 1.0)


@pytest.mark.parametrize("views", [2, 3])
def test_noisy_views_share_the_clean_stream_and_draw_their_own_masks(views):
    rows, n, b = 500, 8, 4
    config, canvas = _full_batch(rows, n, b)
    c = config.prompt_len + n
    one = corrupt(canvas, config, CorruptionConfig(), mask_id=TOK.mask_id, rng=np.random.default_rng(5))
    many = corrupt(canvas, config, CorruptionConfig(views=views), mask_id=TOK.mask_id, rng=np.random.default_rng(5))
    layout = many.layout
    assert many.shape == (rows, c + views * n)
    np.testing.assert_array_equal(layout.tokens[:, :c], one.layout.tokens[:, :c])  # one clean stream
    assert (layout.view_ids[:, :c] == 0).all() and (many.weights[:, :c] == 0).all()
    clean = canvas.tokens[:, config.prompt_len:]
    masks = []
    for k in range(views):
        span = slice(c + k * n, c + (k + 1) * n)
        assert (layout.view_ids[:, span] == k + 1).all()
        for name in ("positions", "block_ids", "valid"):
            np.testing.assert_array_equal(getattr(layout, name)[:, span], getattr(one.layout, name)[:, c:])
        masked = layout.tokens[:, span] == TOK.mask_id
        np.testing.assert_array_equal(np.where(masked, clean, layout.tokens[:, span]), clean)
        np.testing.assert_array_equal(many.targets[:, span], one.targets[:, c:])
        np.testing.assert_array_equal(many.weights[:, span], masked)  # `none`: weight 1 on masked tokens
        assert masked.reshape(rows, -1, b).any(-1).all()  # at least one mask per block, in every view
        masks.append(masked)
    # Independent draws: two views' masks agree no more often than two independent draws would.
    agree = (masks[0] == masks[1]).mean()
    p = masks[0].mean()
    expected = p * p + (1 - p) * (1 - p)
    assert abs(agree - expected) < 5 * np.sqrt(expected * (1 - expected) / masks[0].size)


@pytest.mark.parametrize("views", [0, -1, 1.5, True, "2"])
def test_views_must_be_a_positive_int(views):
    with pytest.raises(ValueError, match="views"):
        CorruptionConfig(views=views)


def test_elbo_denominator_counts_every_view():
    config, canvas = _full_batch(32, 8, 4)
    batch = corrupt(canvas, config, CorruptionConfig(weighting="elbo", views=3), mask_id=TOK.mask_id,
                    rng=np.random.default_rng(0))
    c = config.prompt_len + 8
    # 3 views of 8 valid completion tokens per row: the per-token NELBO over all of them.
    assert batch.denom_weights[:, c:].sum() == 32 * 3 * 8
