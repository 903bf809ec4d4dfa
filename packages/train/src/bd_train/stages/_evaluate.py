"""Held-out evaluation: decode every eval prompt with the sampler, score it with the task's reward.

`Evaluation` holds accuracy (reward 1), mean reward, NFE per generated token and completion
length, a few sample completions, and one row's denoising trace as a picture for the card. With a
mesh, the prompts are split over its data axes and the sharded model samples them (every process
takes part); completions are gathered so that every process scores them all.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from bd_data import PromptBatch, prompt_dataset
from bd_models import to_host

from ._plots import trace_png, trace_text
from ._rollout import roll_out

if TYPE_CHECKING:
    from ._config import SamplerSection
    from ._run import Run


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    completion: str
    reward: float


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Held-out results of one model: the numbers, sample completions and a trace picture."""

    accuracy: float
    mean_reward: float
    n: int
    nfe_per_token: float
    generated_tokens: float
    samples: tuple[Sample, ...] = ()
    trace_png: bytes | None = dataclasses.field(default=None, repr=False)

    def metrics(self) -> dict[str, float | int]:
        """The numbers, by name (for tracking, tables and JSON)."""
        return {"accuracy": self.accuracy, "mean_reward": self.mean_reward, "n": self.n,
                "nfe_per_token": self.nfe_per_token, "generated_tokens": self.generated_tokens}


def evaluate(model: Any, run: Run, *, key: jax.Array, title: str = "", mesh: jax.sharding.Mesh | None = None,
             sampler: SamplerSection | None = None) -> Evaluation:
    """Decoding of `[eval] n` held-out prompts with `[eval] sampler` (or `sampler`) in fixed-size
    batches (rounded up to a multiple of the mesh's data shards; short batches are padded)."""
    cfg = run.config
    section = cfg.eval
    sampler_config = run.sampler_config(section.sampler if sampler is None else sampler)
    source = run.source("eval")
    examples = [source[i] for i in range(min(section.n, len(source)))]
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    batch_size = -(-min(section.batch_size, len(examples)) // shards) * shards
    batches = prompt_dataset(examples, run.tokenizer, cfg.canvas, seed=0, batch_size=batch_size, shard_index=0,
                             shard_count=1, shuffle=False, num_epochs=1, drop_remainder=False)
    rewards, nfe, generated, samples = [], [], [], []
    first_trace = None
    for i in range(len(batches)):
        batch = cast(PromptBatch, batches[i])
        tokens, valid = batch.tokens, batch.valid
        if len(batch.examples) < batch_size:  # pad the last batch so every call reuses one compiled program
            fill = batch_size - len(batch.examples)
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], fill, 0)])
            valid = np.concatenate([valid, np.repeat(valid[:1], fill, 0)])
        out = roll_out(model, (tokens, valid), batch.examples, sampler_config, tokenizer=run.tokenizer,
                       reward=run.reward, key=jax.random.fold_in(key, i), mesh=mesh)
        rewards.extend(out.rewards.tolist())
        nfe.extend(out.nfe.tolist())
        generated.extend(out.generated.tolist())  # rows stop after their stop block
        shown = max(0, section.samples_shown - len(samples))
        samples.extend(Sample(e.prompt, e.answer, t, r)
                       for e, t, r in zip(batch.examples[:shown], out.texts, out.rewards.tolist()))
        if first_trace is None:
            first_trace = jax.tree.map(lambda x: x[0], to_host(jax.tree.map(lambda x: x[:1], out.rollout.trace)))
    rewards = np.asarray(rewards, np.float64)
    canvas = cfg.canvas
    assert first_trace is not None  # there is at least one eval batch
    picture = trace_png(
        committed=first_trace.committed, tokens=first_trace.tokens, step_valid=first_trace.step_valid,
        block_ids=first_trace.block_ids, first_block=canvas.prompt_len // canvas.block_size,
        num_blocks=canvas.max_new_tokens // canvas.block_size, block_size=canvas.block_size,
        token_text=trace_text(run.tokenizer), title=f"{title} denoising of {examples[0].prompt!r}".strip(),
    )
    return Evaluation(accuracy=float(np.mean(rewards == 1.0)), mean_reward=float(np.mean(rewards)),
                      n=int(len(rewards)), nfe_per_token=float(np.sum(nfe) / max(1, np.sum(generated))),
                      generated_tokens=float(np.mean(generated)), samples=tuple(samples), trace_png=picture)
