"""Held-out evaluation: decode every eval prompt with the sampler, score it with the task's reward.

Reports accuracy (reward 1), mean reward, NFE per generated token and completion length, a few
sample completions, and one row's denoising trace for the card. With a mesh, the prompts are split
over its data axes and the sharded model samples them (every process takes part); completions
are gathered so that every process scores them all.
"""

from __future__ import annotations

import dataclasses
import jax
import numpy as np
from bd_data import prompt_dataset
from bd_models import decode_completions, sample, shard_batch, to_host

from ._pipeline_config import EvalSection
from ._plots import trace_png
from ._stage_setup import Setup, trace_text


def evaluate(model, setup: Setup, section: EvalSection, *, key: jax.Array, title: str = "",
             mesh: jax.sharding.Mesh | None = None) -> dict:
    """Greedy (or as configured) decoding of `section.n` held-out prompts in fixed-size batches
    (rounded up to a multiple of the mesh's data shards; short batches are padded)."""
    cfg, tok = setup.config, setup.tokenizer
    sampler = setup.sampler_config(section.sampler)
    source = setup.source("eval")
    examples = [source[i] for i in range(min(section.n, len(source)))]
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    batch_size = -(-min(section.batch_size, len(examples)) // shards) * shards
    batches = prompt_dataset(examples, tok, cfg.canvas, seed=0, batch_size=batch_size, shard_index=0, shard_count=1,
                             shuffle=False, num_epochs=1, drop_remainder=False)
    rewards, nfe, generated, samples = [], [], [], []
    first_trace = None
    for i in range(len(batches)):
        batch = batches[i]
        rows = len(batch.examples)
        tokens, valid = batch.tokens, batch.valid
        if rows < batch_size:  # pad the last batch so every call reuses one compiled program
            fill = batch_size - rows
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], fill, 0)])
            valid = np.concatenate([valid, np.repeat(valid[:1], fill, 0)])
        prompts = (tokens, valid) if mesh is None else shard_batch((tokens, valid), mesh)
        rollout = sample(model, prompts, sampler, key=jax.random.fold_in(key, i))
        completions = to_host(dataclasses.replace(rollout, trace=None))  # the per-row arrays, gathered once
        texts = decode_completions(tok, completions, stop_ids=sampler.stop_ids)[:rows]
        for example, text in zip(batch.examples, texts):
            reward = setup.reward(example, text)
            rewards.append(reward)
            if len(samples) < section.samples_shown:
                samples.append({"prompt": example.prompt, "answer": example.answer, "completion": text,
                                "reward": reward})
        nfe.extend(completions.nfe[:rows].tolist())
        generated.extend(completions.completion_valid[:rows].sum(axis=1).tolist())  # rows stop after their stop block
        if first_trace is None:
            first_trace = jax.tree_util.tree_map(lambda x: x[0], to_host(jax.tree.map(lambda x: x[:1], rollout.trace)))
    rewards = np.asarray(rewards, np.float64)
    canvas = cfg.canvas
    picture = trace_png(
        committed=first_trace.committed, tokens=first_trace.tokens, step_valid=first_trace.step_valid,
        block_ids=first_trace.block_ids, first_block=canvas.prompt_len // canvas.block_size,
        num_blocks=canvas.max_new_tokens // canvas.block_size, block_size=canvas.block_size,
        token_text=trace_text(tok), title=f"{title} denoising of {examples[0].prompt!r}".strip(),
    )
    return {
        "evaluation": {
            "accuracy": float(np.mean(rewards == 1.0)),
            "mean_reward": float(np.mean(rewards)),
            "n": int(len(rewards)),
            "nfe_per_token": float(np.sum(nfe) / max(1, np.sum(generated))),
            "generated_tokens": float(np.mean(generated)),
        },
        "samples": samples,
        "trace_png": picture,
    }
