"""The sampler: config validation, the shared sampling distribution against a numpy reference,
the draw against `jax.random.categorical`, determinism and diversity, compile-once, KV cache ==
full recompute, stops, commit schedules."""

from __future__ import annotations

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bd_models import (
    BlockDiffusionLM,
    ConfigError,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    completion_ids,
    confidence,
    decode_completions,
    entropy,
    first_argmax,
    sample,
    sampling_logprobs,
    token_logprob,
)
from bd_models._sampling_dist import gumbel_max

VOCAB, MASK, PAD, BLOCK = 32, 31, 30, 4
STOPS = (3, 5, 7)  # frequent enough under a random model that rows stop mid-generation
MODEL = BlockDiffusionLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                                     block_size=BLOCK, q_tile=16, k_tile=16), key=jax.random.PRNGKey(0))


def config(*, temperature=1.0, top_k=None, top_p=None, **changes) -> SamplerConfig:
    base = dict(block_size=BLOCK, max_new_tokens=12, mask_id=MASK, pad_id=PAD, threshold=0.5, stop_ids=STOPS)
    distribution = SamplingDistribution(temperature=temperature, top_k=top_k, top_p=top_p)
    return SamplerConfig(**{**base, **changes}, distribution=distribution)


def prompts(seed: int, batch: int = 4, length: int = 8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, PAD, (batch, length)).astype(np.int32)
    valid = np.arange(length)[None, :] >= rng.integers(0, length - 1, (batch, 1))  # left padding
    return np.where(valid, tokens, PAD).astype(np.int32), valid


@pytest.mark.parametrize("changes, field", [
    (dict(max_new_tokens=10), "max_new_tokens"),
    (dict(strategy="greedy"), "strategy"),
    (dict(confidence="logit"), "confidence"),
    (dict(threshold=-0.5), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(steps_per_block=2), "steps_per_block"),  # belongs to strategy='steps'
    (dict(strategy="steps", steps_per_block=5), "steps_per_block"),
    (dict(strategy="steps", max_steps_per_block=2), "max_steps_per_block"),
    (dict(strategy="random", max_steps_per_block=2), "max_steps_per_block"),
    (dict(strategy="random", steps_per_block=0), "steps_per_block"),
    (dict(stop_ids=(MASK,)), "stop_ids"),
])
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"SamplerConfig\.{field}:"):
        config(**changes)


@pytest.mark.parametrize("changes, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(banned_ids=(-1,)), "banned_ids"),
])
def test_distribution_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"SamplingDistribution\.{field}:"):
        SamplingDistribution(**changes)


def test_config_checks_against_the_model():
    with pytest.raises(ConfigError, match="block_size"):
        sample(MODEL, prompts(0), config(block_size=2, max_new_tokens=12), key=jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match="top_k"):
        sample(MODEL, prompts(0), config(top_k=VOCAB + 1), key=jax.random.PRNGKey(0))
    assert config(stop_ids=[3, 5]).stop_ids == (3, 5) and hash(config(stop_ids=[3, 5]))


def test_config_holds_the_distribution_with_mask_and_pad_banned():
    distribution = SamplingDistribution(temperature=0.7, top_k=5, top_p=0.9, banned_ids=(2,))
    cfg = config().replace(distribution=distribution, threshold=0.25)
    assert cfg.banned_ids == cfg.distribution.banned_ids == (2, PAD, MASK)
    assert cfg.distribution.to_dict() == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "banned_ids": [2, PAD, MASK]}
    # the values as configured, flattened under the keys fingerprints read
    assert cfg.to_dict() == dict(block_size=BLOCK, max_new_tokens=12, mask_id=MASK, pad_id=PAD, temperature=0.7,
                                 top_k=5, top_p=0.9, strategy="threshold", threshold=0.25, steps_per_block=None,
                                 max_steps_per_block=None, confidence="probability", stop_ids=STOPS)
    assert cfg.replace(mask_id=29).banned_ids == (2, 29, PAD)  # the old mask id is samplable again
    assert SamplingDistribution(temperature=0).greedy and not SamplingDistribution(temperature=0).unfiltered().greedy
    assert distribution.with_banned((9, 2)).banned_ids == (2, 9)


def reference_logprobs(logits, temperature, top_k, top_p, banned):
    """Float64 numpy reference: ban, temper, keep the top k, then the smallest top-p prefix."""
    x = np.asarray(logits, np.float64).copy()
    x[..., list(banned)] = -np.inf
    x = x / temperature
    if top_k is not None:
        kth = -np.sort(-x, axis=-1)[..., top_k - 1:top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p is not None:
        out = np.zeros_like(p)
        for idx in np.ndindex(p.shape[:-1]):
            order = np.argsort(-p[idx], kind="stable")
            mass, keep = 0.0, []
            for i in order:
                if mass >= top_p:
                    break
                keep.append(i)
                mass += p[idx][i]
            out[idx][keep] = p[idx][keep]
        p = out / out.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log(p)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.5, 5, None), (1.3, None, 0.7),
                                                       (0.8, 7, 0.6), (0.3, 1, 0.9)])
def test_sampling_logprobs_match_reference(temperature, top_k, top_p):
    logits = jax.random.normal(jax.random.PRNGKey(1), (3, 5, VOCAB)) * 2.0
    got = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p, banned_ids=(MASK, PAD))
    want = reference_logprobs(logits, temperature, top_k, top_p, (MASK, PAD))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(got)[finite], want[finite], atol=2e-5)
    assert np.all(np.isneginf(np.asarray(got)[..., [MASK, PAD]]))
    # traced knobs (how the sampler calls it) give the same numbers as Python ones (how scoring may)
    traced = jax.jit(lambda t, k, p: sampling_logprobs(
        logits, temperature=t, top_k=None if top_k is None else k, top_p=None if top_p is None else p,
        banned_ids=(MASK, PAD)))(jnp.float32(temperature), jnp.int32(top_k or 0), jnp.float32(top_p or 1.0))
    np.testing.assert_allclose(traced, got, atol=1e-6)
    # the distribution object is that function, eagerly and traced under filter_jit
    distribution = SamplingDistribution(temperature=temperature, top_k=top_k, top_p=top_p, banned_ids=(PAD, MASK))
    np.testing.assert_array_equal(distribution.logprobs(logits), got)
    np.testing.assert_allclose(eqx.filter_jit(lambda d: d.logprobs(logits))(distribution), got, atol=1e-6)


def test_greedy_and_confidence_rules():
    logits = jax.random.normal(jax.random.PRNGKey(2), (6, VOCAB))
    greedy = sampling_logprobs(logits, temperature=0, banned_ids=(MASK,))
    np.testing.assert_array_equal(SamplingDistribution(temperature=0, banned_ids=(MASK,)).logprobs(logits), greedy)
    best = np.argmax(np.where(np.arange(VOCAB) == MASK, -np.inf, logits), -1)
    np.testing.assert_array_equal(np.argmax(greedy, -1), best)
    assert np.all(np.sum(np.isfinite(greedy), -1) == 1)
    logp = sampling_logprobs(logits, temperature=1.0)
    tokens = jnp.argmax(logp, -1)
    p = np.exp(np.asarray(logp, np.float64))
    top2 = -np.sort(-p, -1)[:, :2]
    np.testing.assert_allclose(confidence(logp, tokens, "probability"), top2[:, 0], rtol=1e-5)
    np.testing.assert_allclose(confidence(logp, tokens, "margin"), top2[:, 0] - top2[:, 1], rtol=1e-4)
    np.testing.assert_allclose(entropy(logp), -np.sum(p * np.log(p), -1), rtol=1e-5)
    np.testing.assert_allclose(confidence(logp, tokens, "entropy"), np.exp(-np.sum(-p * np.log(p), -1)), rtol=1e-5)


# few distinct values, so rows tie often; -inf and NaN included
_ENTRIES = st.sampled_from([0.0, 1.0, 2.0, -1.5, float("-inf"), float("inf"), float("nan")])


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4).flatmap(lambda rows: st.integers(1, 9).flatmap(
    lambda v: st.lists(_ENTRIES, min_size=rows * v, max_size=rows * v).map(
        lambda xs: np.asarray(xs, np.float32).reshape(rows, v)))))
def test_first_argmax_is_argmax(x):
    """The first maximum, the first NaN where there is one: argmax's ties and NaN rule, eager and
    under jit."""
    want = np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), want)
    np.testing.assert_array_equal(jax.jit(first_argmax)(x), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9).flatmap(lambda v: st.tuples(
    st.lists(st.floats(-1e6, 0.0, width=32) | st.just(-np.inf), min_size=3 * v, max_size=3 * v),
    st.lists(st.integers(-2, v + 1), min_size=3, max_size=3))))
def test_token_logprob_is_the_entry_and_nan_outside_the_vocabulary(case):
    """Each in-vocabulary token's entry bit for bit (as a gather gives it, -inf included); NaN for
    an id outside the vocabulary, negative ones too (a gather would wrap those)."""
    entries, tokens = case
    logp = np.asarray(entries, np.float32).reshape(3, -1)
    tokens = np.asarray(tokens, np.int32)
    inside = (tokens >= 0) & (tokens < logp.shape[1])
    want = np.where(inside, logp[np.arange(3), np.clip(tokens, 0, logp.shape[1] - 1)], np.nan)
    np.testing.assert_array_equal(token_logprob(jnp.asarray(logp), jnp.asarray(tokens)), want)
    np.testing.assert_array_equal(jax.jit(token_logprob)(logp, tokens), want)


def test_gumbel_max_draws_what_categorical_draws():
    """The same token as `jax.random.categorical` for every key, inside a jitted loop as the sampler
    draws (where XLA fuses the noise into the reductions), banned ids included."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (8, 4, VOCAB)) * 3.0
    logp = sampling_logprobs(logits, temperature=0.7, banned_ids=(MASK, PAD))

    def draws(draw):
        def body(i, out):
            key = jax.random.fold_in(jax.random.PRNGKey(4), i)
            return out.at[i].set(draw(key, logp + 0.01 * i.astype(jnp.float32)).astype(jnp.int32))
        return jax.jit(lambda: jax.lax.fori_loop(0, 64, body, jnp.zeros((64, 8, 4), jnp.int32)))()

    got = draws(gumbel_max)
    np.testing.assert_array_equal(got, draws(lambda key, lp: jax.random.categorical(key, lp, axis=-1)))
    assert not np.isin(np.asarray(got), (MASK, PAD)).any()
    assert len(np.unique(np.asarray(got))) > VOCAB // 2  # draws, not one argmax


def check_rollout(out, cfg: SamplerConfig, prefill: int):
    """Structural invariants of any rollout: whole blocks, stops end a row, every generated
    position committed exactly once by a valid step of its block, NFE = prefill + valid steps."""
    out.validate()
    b, P = cfg.block_size, out.prompt_tokens.shape[1]
    tokens, valid = np.asarray(out.completion_tokens), np.asarray(out.completion_valid)
    tr = {k: np.asarray(getattr(out.trace, k)) for k in ("block_ids", "committed", "tokens", "step_valid")}
    for r in range(tokens.shape[0]):
        blocks_valid = valid[r].reshape(-1, b)
        assert np.all(blocks_valid == blocks_valid[:, :1]), "validity comes in whole blocks"
        n_valid = int(blocks_valid[:, 0].sum())
        assert np.all(blocks_valid[:n_valid]) and not np.any(blocks_valid[n_valid:])
        blocks = tokens[r].reshape(-1, b)
        has_stop = np.isin(blocks[:n_valid], cfg.stop_ids).any(-1)
        assert not has_stop[:-1].any(), "a row stops after its first block with a stop id"
        assert n_valid == len(blocks) or has_stop[-1]
        assert np.all(blocks[n_valid:] == cfg.pad_id)
        assert not np.isin(blocks[:n_valid], cfg.banned_ids).any()
        steps = tr["step_valid"][r]
        for j in range(len(blocks)):
            in_block = steps & (tr["block_ids"][r] == P // b + j)
            counts = tr["committed"][r][in_block].sum(0)
            if j < n_valid:
                assert np.all(counts == 1) and 1 <= in_block.sum() <= cfg.steps_cap
                rebuilt = (tr["tokens"][r][in_block] * tr["committed"][r][in_block]).sum(0)
                np.testing.assert_array_equal(rebuilt, blocks[j])
            else:
                assert in_block.sum() == 0
        assert int(out.nfe[r]) == prefill + int(steps.sum())


def test_threshold_rollout_with_stops_is_well_formed_and_reproducible():
    cfg = config()
    out = sample(MODEL, prompts(1), cfg, key=jax.random.PRNGKey(3))
    check_rollout(out, cfg, prefill=1)
    valid = np.asarray(out.completion_valid)
    assert (~valid).any() and valid[:, 0].all(), "this key is chosen so that some row stops mid-generation"
    again = sample(MODEL, prompts(1), cfg, key=jax.random.PRNGKey(3))
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)
    other = sample(MODEL, prompts(1), cfg, key=jax.random.PRNGKey(4))
    assert not np.array_equal(other.completion_tokens, out.completion_tokens)


def test_group_samples_of_one_prompt_differ():
    tokens, valid = prompts(2, batch=1)
    group = (np.repeat(tokens, 4, 0), np.repeat(valid, 4, 0))
    out = sample(MODEL, group, config(), key=jax.random.PRNGKey(5))
    completions = {tuple(row) for row in np.asarray(out.completion_tokens)}
    assert len(completions) > 1


@pytest.mark.parametrize("first, second", [
    (dict(), dict(temperature=0.7, threshold=0.8, top_k=None)),
    (dict(temperature=0.9, top_k=5, top_p=0.8, threshold=0.6), dict(temperature=0.6, top_k=12, top_p=0.95,
                                                                    threshold=0.3)),
])
def test_second_call_of_a_bucket_compiles_nothing(first, second):
    compiles = []
    sample(MODEL, prompts(6), config(**first), key=jax.random.PRNGKey(6))
    # built before listening: its initialisation's small programs are not the sampler's (and may
    # compile again here, after the suite drops JAX's caches between test files)
    new_model = BlockDiffusionLM(MODEL.config, key=jax.random.PRNGKey(9))
    new_prompts, key = prompts(7), jax.random.PRNGKey(7)
    here = threading.get_ident()  # a program compiles on the thread that calls it; another thread's is not ours
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" and threading.get_ident() == here else None)
    try:
        out = sample(new_model, new_prompts, config(**second), key=key)
        out.completion_tokens.block_until_ready()
    finally:
        jax.monitoring.clear_event_listeners()
    assert compiles == [], "new prompts, weights and knob values of one bucket must reuse the compiled program"


@pytest.mark.parametrize("cfg", [config(temperature=0.6, top_k=9, top_p=0.9),
                                 config(strategy="steps", steps_per_block=2, confidence="margin", threshold=0.9)])
def test_cached_sampling_equals_full_recompute(cfg):
    tokens, valid = prompts(8)
    cached = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(8))
    recompute = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(8), use_cache=False)
    np.testing.assert_array_equal(cached.completion_tokens, recompute.completion_tokens)
    np.testing.assert_array_equal(cached.trace.committed, recompute.trace.committed)
    np.testing.assert_allclose(cached.trace.logprobs, recompute.trace.logprobs, atol=1e-5, rtol=0)
    check_rollout(cached, cfg, prefill=1)
    if cfg.strategy == "steps":  # 2 steps per block, 2 tokens each, for every generated block
        committed = np.asarray(cached.trace.committed).sum(-1)[np.asarray(cached.trace.step_valid)]
        assert np.all(committed == 2)


@pytest.mark.parametrize("strategy", ["threshold", "steps"])
def test_no_sampling_knob_changes_which_positions_commit(strategy):
    """Confidence is scored under the model's own distribution: on the same canvas, temperature,
    top-k and top-p change the sampled tokens but not the positions a confidence rule commits."""
    extra = dict(steps_per_block=2) if strategy == "steps" else dict(threshold=0.3)
    tokens, valid = prompts(12)
    first_steps = []
    for knobs in (dict(temperature=1.0), dict(temperature=0.3, top_k=4, top_p=0.5), dict(temperature=0.0)):
        cfg = config(strategy=strategy, confidence="margin", stop_ids=(), **extra, **knobs)
        out = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(12))
        first_steps.append(np.asarray(out.trace.committed[:, 0]))
    for other in first_steps[1:]:
        np.testing.assert_array_equal(other, first_steps[0])


def test_random_schedule_does_not_depend_on_the_model():
    """`random` draws which positions commit from the key alone: other weights, other temperature,
    same schedule; and each step commits its fixed count."""
    cfg = config(strategy="random", steps_per_block=3, stop_ids=())  # counts per step: 2, 1, 1
    tokens, valid = prompts(13)
    out = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(13))
    check_rollout(out, cfg, prefill=1)
    other_model = BlockDiffusionLM(MODEL.config, key=jax.random.PRNGKey(14))
    other = sample(other_model, (tokens, valid), cfg.replace(distribution=SamplingDistribution(temperature=0.5)),
                   key=jax.random.PRNGKey(13))
    np.testing.assert_array_equal(other.trace.committed, out.trace.committed)
    assert not np.array_equal(other.completion_tokens, out.completion_tokens)
    counts = np.asarray(out.trace.committed).sum(-1).reshape(len(tokens), -1, 3)
    assert np.all(counts == [2, 1, 1])
    recompute = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(13), use_cache=False)
    np.testing.assert_array_equal(recompute.completion_tokens, out.completion_tokens)
    assert cfg.exact_likelihood and not config().exact_likelihood


def test_one_token_per_step_and_single_block_prompts():
    cfg = config(strategy="steps", stop_ids=())
    tokens, valid = prompts(10, length=BLOCK)
    out = sample(MODEL, (tokens, valid), cfg, key=jax.random.PRNGKey(10))
    check_rollout(out, cfg, prefill=0)  # the only prompt block is committed by the first step
    assert np.all(np.asarray(out.nfe) == cfg.max_new_tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_threshold_above_one_commits_what_one_per_step_does(temperature):
    """`threshold` with a threshold no confidence reaches commits the most confident position each
    step: the same tokens, trace and NFE as `steps` at one per step, from the same key."""
    tokens, valid = prompts(15)
    key = jax.random.PRNGKey(15)
    one = sample(MODEL, (tokens, valid), config(strategy="steps", temperature=temperature), key=key)
    for threshold in (1.5, float("inf")):
        out = sample(MODEL, (tokens, valid), config(threshold=threshold, temperature=temperature), key=key)
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(got, want)
    assert np.asarray(one.trace.committed).sum(-1).max() == 1


class _Letters:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_decode_drops_everything_after_the_first_stop():
    cfg = config()
    out = sample(MODEL, prompts(1), cfg, key=jax.random.PRNGKey(3))
    texts = decode_completions(_Letters(), out, stop_ids=cfg.stop_ids)
    for text, ids, tokens, valid in zip(texts, completion_ids(out, stop_ids=cfg.stop_ids),
                                        np.asarray(out.completion_tokens), np.asarray(out.completion_valid)):
        generated = tokens[valid].tolist()
        cut = next((i for i, t in enumerate(generated) if t in cfg.stop_ids), len(generated))
        assert ids == generated[:cut] and text == _Letters().decode(generated[:cut])
