"""The compile-once block-diffusion sampler with exact denoising traces.

Block by block over a left-padded canvas: each step samples every masked position of the block
from the config's `SamplingDistribution`, commits a confident set and records it
(`DiffusionTrace`). The clean commit of block j-1 rides in the first step of block j, so a block
costs only its denoising steps. Shape letters: see bd_core (B, P, N, C = P + N, b, R, V).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray

from bd_core import CLEAN_VIEW, DiffusionTrace, RolloutOutput, ViewLayout, config_error

from ._sampler_config import SamplerConfig
from ._sampling_dist import confidence, gumbel_max, token_logprob

NOISY_VIEW = 1


def _layout(tokens, positions, block_ids, view_id: int, valid) -> ViewLayout:
    shape = tokens.shape
    return ViewLayout(
        tokens=tokens.astype(jnp.int32),
        positions=jnp.broadcast_to(positions, shape).astype(jnp.int32),
        block_ids=jnp.broadcast_to(block_ids, shape).astype(jnp.int32),
        view_ids=jnp.full(shape, view_id, jnp.int32),
        valid=jnp.broadcast_to(valid, shape),
    )


def concat_layouts(*layouts: ViewLayout) -> ViewLayout:
    """The views of several `ViewLayout`s packed side by side along the token axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=1), *layouts)


class _Canvas(eqx.Module):
    """The uncached reference's stand-in for a KV cache: the committed clean canvas itself."""

    tokens: Array
    valid: Array


class RecomputeModel(eqx.Module):
    """Wraps a model so that `forward_cached` reruns the full packed layout (clean canvas + chunk)
    through `model(layout)`: the reference the KV cache must match, and its speed baseline."""

    model: Any

    @property
    def config(self):
        return self.model.config

    def init_cache(self, batch_size: int, max_len: int) -> _Canvas:
        """An empty canvas for up to `max_len` positions (the recompute model's stand-in for a KV cache)."""
        return _Canvas(jnp.zeros((batch_size, max_len), jnp.int32), jnp.zeros((batch_size, max_len), bool))

    def layer_list(self) -> None:
        """None: the recompute model has no layers to split."""
        return None

    def forward_cached(self, chunk: ViewLayout, cache: _Canvas, *, commit=None, layers=None):
        """Logits of `chunk`, recomputed over the whole clean canvas with no cache; then the `commit`-flagged tokens
        join the canvas."""
        batch, length = cache.tokens.shape
        positions = jnp.arange(length, dtype=jnp.int32)
        clean = _layout(cache.tokens, positions, positions // self.config.block_size, CLEAN_VIEW, cache.valid)
        logits = self.model(concat_layouts(clean, chunk))[:, length:]
        if commit is not None:
            rows = jnp.arange(batch)[:, None]
            slots = jnp.where(commit, chunk.positions, length)  # out of range: dropped
            cache = _Canvas(cache.tokens.at[rows, slots].set(chunk.tokens, mode="drop"),
                            cache.valid.at[rows, slots].set(True, mode="drop"))
        return logits, cache


def _empty_trace(batch: int, steps: int, block: int) -> DiffusionTrace:
    """A trace of `steps` steps with nothing recorded (it is filled step by step inside jit)."""
    return DiffusionTrace(jnp.zeros((batch, steps), jnp.int32), jnp.zeros((batch, steps, block), bool),
                          jnp.zeros((batch, steps, block), jnp.int32), jnp.zeros((batch, steps, block), jnp.float32),
                          jnp.zeros((batch, steps), bool))


def _record(trace: DiffusionTrace, r, block_id, committed_Bxb, tokens_Bxb, logprobs_Bxb, live_B) -> DiffusionTrace:
    """`trace` with step `r` recorded; rows that are not live record an invalid, empty step."""
    return DiffusionTrace(
        trace.block_ids.at[:, r].set(jnp.where(live_B, block_id, 0)),
        trace.committed.at[:, r].set(committed_Bxb),
        trace.tokens.at[:, r].set(jnp.where(committed_Bxb, tokens_Bxb, 0)),
        trace.logprobs.at[:, r].set(jnp.where(committed_Bxb, logprobs_Bxb, 0.0)),
        trace.step_valid.at[:, r].set(live_B),
    )


class _Block(NamedTuple):
    """Per-block state of the denoising loop."""

    step: Array  # scalar int32
    tokens: Array  # [B, b] committed tokens, mask_id elsewhere
    masked: Array  # [B, b]
    trace: DiffusionTrace
    nfe: Array  # [B]


def _commit_set(conf, masked, step, key, config: SamplerConfig):
    """Which masked positions to commit this step (`[B, b]`): the strategy, then the last-step rule.
    `random` ignores `conf`: its positions are a uniform draw of `counts[step]` among the masked
    ones (the masked positions that come first in a uniform random permutation of the block)."""
    b = config.block_size
    if config.strategy == "threshold":
        conf = jnp.where(masked, conf, -jnp.inf)
        best = jax.nn.one_hot(jnp.argmax(conf, axis=-1), b, dtype=bool)
        pick = (conf >= jnp.asarray(config.threshold, jnp.float32)) | best
    else:
        steps = config.steps_cap
        counts = jnp.asarray([b // steps + (i < b % steps) for i in range(steps)], jnp.int32)
        if config.strategy == "random":
            keys = jax.random.split(key, masked.shape[0])
            priority = jax.vmap(lambda k: jax.random.permutation(k, b))(keys)  # distinct: no ties
            order = jnp.where(masked, priority, b + jnp.arange(b))  # masked positions first
        else:
            order = jnp.where(masked, -conf, jnp.inf)
        rank = jnp.argsort(jnp.argsort(order, axis=-1, stable=True), axis=-1, stable=True)
        pick = rank < counts[step]
    return masked & (pick | (step == config.steps_cap - 1))


def _denoise(state: _Block, logits, j, live, key, config: SamplerConfig, first_block) -> _Block:
    """Sample block `j`'s masked positions from its `logits` `[B, b, V]`, commit a set, record it."""
    cap = config.steps_cap
    step_key = jax.random.fold_in(jax.random.fold_in(key, j), state.step)
    distribution = config.distribution
    logp = distribution.logprobs(logits)
    tokens = gumbel_max(step_key, logp)
    # one rule: confidence is the model's own (unfiltered, temperature-1) belief in the sampled
    # token, so temperature, top-k and top-p change what is sampled, never how much commits
    conf = confidence(distribution.unfiltered().logprobs(logits), tokens, config.confidence)
    commit = _commit_set(conf, state.masked, state.step, jax.random.fold_in(step_key, 1), config)
    commit = commit & live[:, None]
    trace = _record(state.trace, j * cap + state.step, first_block + j, commit, tokens,
                    token_logprob(logp, tokens), live)
    return _Block(state.step + 1, jnp.where(commit, tokens, state.tokens), state.masked & ~commit, trace,
                  state.nfe + live.astype(jnp.int32))


def _denoising_step(model, cache, layers, state: _Block, j, active, key, config: SamplerConfig,
                    prompt_len: int) -> _Block:
    """One step of block `j`'s denoising loop after its first (the loop's body): the block's noisy
    view against the KV cache, then `_denoise` for the rows still `active` with masked positions.
    `lower_denoising_step` lowers it alone, for a plan's per-step cost."""
    b = config.block_size
    first_block = prompt_len // b
    positions = prompt_len + j * b + jnp.arange(b, dtype=jnp.int32)
    live = active & jnp.any(state.masked, axis=-1)
    logits, _ = model.forward_cached(_layout(state.tokens, positions, first_block + j, NOISY_VIEW, True), cache,
                                     layers=layers)
    return _denoise(state, logits, j, live, key, config, first_block)


def _generate(model, prompt_tokens, prompt_valid, key, config: SamplerConfig):
    batch, prompt_len = prompt_tokens.shape
    b, n_blocks, cap = config.block_size, config.num_blocks, config.steps_cap
    first_block = prompt_len // b
    offsets = jnp.arange(b, dtype=jnp.int32)
    cache = model.init_cache(batch, prompt_len + config.max_new_tokens)
    layers = model.layer_list()  # split once here, not in every step
    nfe = jnp.zeros((batch,), jnp.int32)
    if prompt_len > b:  # the last prompt block is committed by the first denoising step instead
        head = prompt_len - b
        positions = jnp.arange(head, dtype=jnp.int32)
        prefill = _layout(prompt_tokens[:, :head], positions, positions // b, CLEAN_VIEW, prompt_valid[:, :head])
        _, cache = model.forward_cached(prefill, cache, commit=prefill.valid, layers=layers)
        nfe = nfe + 1

    def denoise(state: _Block, logits, j, live) -> _Block:
        return _denoise(state, logits, j, live, key, config, first_block)

    def block_body(carry):
        j, cache, canvas, canvas_valid, done, prev_tokens, prev_valid, trace, nfe = carry
        active = ~done
        block_id = first_block + j
        positions = prompt_len + j * b + offsets
        noisy = lambda toks: _layout(toks, positions, block_id, NOISY_VIEW, True)  # noqa: E731
        state = _Block(jnp.int32(0), jnp.full((batch, b), config.mask_id, jnp.int32),
                       jnp.ones((batch, b), bool), trace, nfe)
        # step 0 also writes the previous block's clean K/V: [clean block j-1 | noisy block j]
        clean_prev = _layout(prev_tokens, positions - b, block_id - 1, CLEAN_VIEW, prev_valid)
        chunk = concat_layouts(clean_prev, noisy(state.tokens))
        logits, cache = model.forward_cached(chunk, cache, commit=jnp.concatenate(
            [prev_valid, jnp.zeros((batch, b), bool)], axis=1), layers=layers)
        state = denoise(state, logits[:, b:], j, active)

        def live(s: _Block):
            return active & jnp.any(s.masked, axis=-1)

        def step_body(s: _Block) -> _Block:
            return _denoising_step(model, cache, layers, s, j, active, key, config, prompt_len)

        state = jax.lax.while_loop(lambda s: (s.step < cap) & jnp.any(live(s)), step_body, state)
        block = jnp.where(active[:, None], state.tokens, config.pad_id)
        canvas = jax.lax.dynamic_update_slice_in_dim(canvas, block, j * b, axis=1)
        canvas_valid = jax.lax.dynamic_update_slice_in_dim(
            canvas_valid, jnp.broadcast_to(active[:, None], (batch, b)), j * b, axis=1)
        if config.stop_ids:
            stopped = jnp.any(jnp.isin(state.tokens, jnp.asarray(config.stop_ids, jnp.int32)), axis=-1)
            done = done | (stopped & active)
        prev_valid = jnp.broadcast_to(active[:, None], (batch, b))
        return (j + 1, cache, canvas, canvas_valid, done, state.tokens, prev_valid, state.trace, state.nfe)

    carry = (jnp.int32(0), cache,
             jnp.full((batch, config.max_new_tokens), config.pad_id, jnp.int32),
             jnp.zeros((batch, config.max_new_tokens), bool), jnp.zeros((batch,), bool),
             prompt_tokens[:, -b:], prompt_valid[:, -b:], _empty_trace(batch, n_blocks * cap, b), nfe)
    carry = jax.lax.while_loop(lambda c: (c[0] < n_blocks) & ~jnp.all(c[4]), block_body, carry)
    _, _, canvas, canvas_valid, _, _, _, trace, nfe = carry
    return RolloutOutput(prompt_tokens, prompt_valid, canvas, canvas_valid, nfe, trace=trace)


_generate_jit = eqx.filter_jit(_generate)


def sample(
    model,
    prompts: tuple[Int[ArrayLike, "B P"], Bool[ArrayLike, "B P"]],
    config: SamplerConfig,
    *,
    key: PRNGKeyArray,
    use_cache: bool = True,
) -> RolloutOutput:
    """Generate `config.max_new_tokens` after each left-padded prompt, with an exact trace.

    `prompts` is `(tokens [B, P] int32, valid [B, P] bool)`, P a multiple of the block size.
    Compiled once per (B, P) and config structure (lengths, strategy, confidence rule, stop ids,
    which filters are on, greedy or not); the config's leaves (temperature, top-k, top-p and
    threshold values) and the weights are traced.
    `use_cache=False` reruns the whole canvas every step (the reference and speed baseline).
    The trace's `block_ids` are canvas blocks (`position // block_size`); `nfe[r]` counts the
    forward passes in which row r took part (prefill included).

    Args:
        model: a `BlockDiffusionLM` (or anything with its `forward_cached`).
        prompts: `(tokens [B, P], valid [B, P])`, left-padded (`bd_data.prompt_dataset` makes them).
        config: lengths, ids, the sampling distribution and the commit strategy.
        key: the sampling key.
        use_cache: False recomputes the whole canvas every step.

    Returns:
        The completions, their trace (what committed at every step, with its log-probabilities) and
        the NFE per row.

    Example:
        ```python
        import jax
        from bd_data import ByteTokenizer, CanvasConfig, get_task, iterate, prompt_dataset
        from bd_models import (BlockDiffusionLM, ModelConfig, SamplerConfig, SamplingDistribution,
                               decode_completions, sample)

        task, tok = get_task("argsort", length=6), ByteTokenizer()
        canvas = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
        model = BlockDiffusionLM(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4,
                                             n_kv_heads=4, d_ff=256, block_size=4), key=jax.random.key(0))
        greedy = SamplerConfig(block_size=4, max_new_tokens=8, mask_id=tok.mask_id, pad_id=tok.pad_id,
                               distribution=SamplingDistribution(temperature=0.0), stop_ids=(tok.eos_id,))
        prompts = next(iterate(prompt_dataset(task.dataset("eval"), tok, canvas, seed=0, batch_size=4)))
        rollout = sample(model, (prompts.tokens, prompts.valid), greedy, key=jax.random.key(1))
        texts = decode_completions(tok, rollout, stop_ids=(tok.eos_id,))  # an untrained model's 4 texts
        ```
    """
    prompt_tokens, prompt_valid = (jnp.asarray(prompts[0], jnp.int32), jnp.asarray(prompts[1], bool))
    if prompt_tokens.ndim != 2 or prompt_valid.shape != prompt_tokens.shape:
        raise ValueError(f"sample: prompts must be (tokens [B, P], valid [B, P]) of one shape, got "
                         f"{prompt_tokens.shape} and {prompt_valid.shape}")
    model_config = model.config
    if model_config.block_size != config.block_size:
        raise config_error("SamplerConfig", "block_size", config.block_size,
                           f"the model's block_size={model_config.block_size}", "set them equal")
    config.check_vocab(model_config.vocab_size)
    prompt_len = prompt_tokens.shape[1]
    if prompt_len < config.block_size or prompt_len % config.block_size:
        raise ValueError(f"sample: prompt length {prompt_len} must be a positive multiple of block_size="
                         f"{config.block_size}; left-pad the prompts (valid=False) to such a length")
    engine = model if use_cache else RecomputeModel(model)
    return _generate_jit(engine, prompt_tokens, prompt_valid, key, config)
