"""Held-out evaluation: decode every eval prompt with the sampler, score it with the task's reward.

`evaluate` gives greedy accuracy (reward 1), mean reward, NFE per generated token and completion
length, a few sample completions and one row's denoising trace as a picture for the card.
`evaluate_report` adds what `[eval] samples`, `best_of` and `thresholds` ask for: pass@k with the
unbiased estimator (`samples` rollouts per problem at the rollout decoding, `[grpo] sampler`),
best-of-n over those same rollouts chosen without the reference (`_best_of`), and accuracy
against NFE per token over decoding thresholds and one token per step. With a mesh, the prompts
are split over its data axes and the sharded model samples them (every process takes part);
completions are gathered so that every process scores them all.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from bd_data import Example, PromptBatch, prompt_dataset
from bd_models import SamplerConfig, to_host

from ._best_of import BestOfN, best_of_n
from ._plots import accuracy_nfe_png, trace_png, trace_text
from ._rollout import roll_out

if TYPE_CHECKING:
    from ._run import Run
    from ._stage_sections import SamplerSection

ONE_PER_STEP = "one per step"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One held-out problem as a card shows it.

    Attributes:
        prompt: the prompt text.
        answer: the reference answer.
        completion: what the model generated (up to its first stop token).
        reward: the task's reward of the completion."""
    prompt: str
    answer: str
    completion: str
    reward: float


@dataclasses.dataclass(frozen=True)
class NFEPoint:
    """Held-out results at one decoding setting; `tokens_per_second` is timed after compilation
    (None where it was not timed).

    Attributes:
        decoding: the setting, e.g. `τ 0.9` or one token per step.
        accuracy: the share of exact answers.
        mean_reward: the mean task reward.
        nfe_per_token: forward passes per generated token.
        tokens_per_second: generated tokens per second after compilation (None: not timed).
    """

    decoding: str
    accuracy: float
    mean_reward: float
    nfe_per_token: float
    tokens_per_second: float | None = None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Held-out results of one model: the greedy numbers, sample completions and a trace picture;
    with `evaluate_report`, also pass@k, best-of-n and the accuracy-vs-NFE curve (and its picture).

    Attributes:
        accuracy: the share of exact answers (greedy by default).
        mean_reward: the mean task reward.
        n: held-out problems.
        nfe_per_token: forward passes per generated token.
        generated_tokens: generated tokens per problem.
        samples: sample completions.
        trace_png: one denoising trace as a PNG.
        pass_at_k: `{"pass@1": ..., "pass@2": ...}`.
        samples_per_problem: samples per problem behind pass@k.
        accuracy_vs_nfe: one point per decoding setting.
        curve_png: the accuracy-vs-NFE plot.
        rewards: each problem's greedy reward, in order.
        correct_samples: each problem's count of correct pass@k samples.
        best_of: best-of-n over the pass@k samples, one per `[eval] best_of` rule.
    """

    accuracy: float
    mean_reward: float
    n: int
    nfe_per_token: float
    generated_tokens: float
    samples: tuple[Sample, ...] = ()
    trace_png: bytes | None = dataclasses.field(default=None, repr=False)
    pass_at_k: Mapping[str, float] = dataclasses.field(default_factory=dict)  # {"pass@1": ..., "pass@4": ...}
    samples_per_problem: int = 0
    accuracy_vs_nfe: tuple[NFEPoint, ...] = ()
    curve_png: bytes | None = dataclasses.field(default=None, repr=False)
    # Per problem, in `eval_examples` order: the greedy reward, and how many of the pass@k samples
    # were correct; two models evaluated on the same problems compare pairwise through them.
    rewards: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    correct_samples: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    best_of: tuple[BestOfN, ...] = ()  # one per `[eval] best_of` rule, over the pass@k samples

    def metrics(self) -> dict[str, float | int]:
        """The numbers, by name (for tracking, tables and JSON)."""
        best = {k: v for b in self.best_of for k, v in b.metrics().items()}
        return {"accuracy": self.accuracy, "mean_reward": self.mean_reward, "n": self.n,
                "nfe_per_token": self.nfe_per_token, "generated_tokens": self.generated_tokens, **self.pass_at_k,
                **best}

    def per_problem(self) -> dict[str, np.ndarray]:
        """Each metric's value per problem, whose mean is the metric: greedy correctness (`accuracy`),
        the greedy reward (`mean_reward`) and each pass@k's unbiased estimate; empty for an
        evaluation that kept no per-problem results."""
        if not self.rewards:
            return {}
        rewards = np.asarray(self.rewards, np.float64)
        out = {"accuracy": (rewards == 1.0).astype(np.float64), "mean_reward": rewards}
        if self.correct_samples and self.samples_per_problem:
            for key in self.pass_at_k:
                k = int(key.removeprefix("pass@"))
                out[key] = np.asarray([pass_at_k(self.samples_per_problem, c, k) for c in self.correct_samples])
        return out


@dataclasses.dataclass(frozen=True)
class _Decoded:
    """Per-row host results of decoding a list of examples (padding rows dropped)."""

    rewards: np.ndarray
    nfe: np.ndarray
    generated: np.ndarray
    texts: list[str]
    first_trace: Any
    logprobs: np.ndarray | None = None  # each row's summed committed log-probs, when asked for

    @property
    def nfe_per_token(self) -> float:
        return float(np.sum(self.nfe) / max(1, np.sum(self.generated)))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from `n` samples of which `c` are correct: 1 − C(n−c, k)/C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_examples(run: Run) -> list[Example]:
    """The held-out problems every evaluation decodes: the first `[eval] n` of the eval split."""
    source = run.source("eval")
    return [source[i] for i in range(min(run.config.eval.n, len(source)))]


def _decode(model: Any, run: Run, examples: Sequence[Example], sampler: SamplerConfig, *, key: jax.Array,
            mesh: jax.sharding.Mesh | None, logprobs: bool = False) -> _Decoded:
    """Decode `examples` in `[eval] batch_size` batches (rounded up to a multiple of the mesh's
    data shards; the last batch is padded so that every call reuses one compiled program);
    `logprobs`: keep each row's summed log-probs too."""
    cfg = run.config
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    batch_size = -(-min(cfg.eval.batch_size, len(examples)) // shards) * shards
    batches = prompt_dataset(list(examples), run.tokenizer, cfg.canvas, seed=0, batch_size=batch_size,
                             shard_index=0, shard_count=1, shuffle=False, num_epochs=1, drop_remainder=False)
    rewards, nfe, generated, texts, sums = [], [], [], [], []
    first_trace = None
    for i in range(len(batches)):
        batch = cast(PromptBatch, batches[i])
        tokens, valid = batch.tokens, batch.valid
        if len(batch.examples) < batch_size:
            fill = batch_size - len(batch.examples)
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], fill, 0)])
            valid = np.concatenate([valid, np.repeat(valid[:1], fill, 0)])
        out = roll_out(model, (tokens, valid), batch.examples, sampler, tokenizer=run.tokenizer, reward=run.reward,
                       key=jax.random.fold_in(key, i), mesh=mesh)
        rewards.extend(out.rewards.tolist())
        nfe.extend(out.nfe.tolist())
        generated.extend(out.generated.tolist())  # rows stop after their stop block
        texts.extend(out.texts)
        if logprobs:
            sums.extend(out.sequence_logprobs().tolist())
        if first_trace is None:
            first_trace = jax.tree.map(lambda x: x[0], to_host(jax.tree.map(lambda x: x[:1], out.rollout.trace)))
    return _Decoded(np.asarray(rewards, np.float64), np.asarray(nfe), np.asarray(generated), texts, first_trace,
                    np.asarray(sums, np.float64) if logprobs else None)


def evaluate(model: Any, run: Run, *, key: jax.Array, title: str = "", mesh: jax.sharding.Mesh | None = None,
             sampler: SamplerSection | None = None) -> Evaluation:
    """Decoding of `[eval] n` held-out prompts with `[eval] sampler` (or `sampler`)."""
    cfg = run.config
    examples = eval_examples(run)
    decoded = _decode(model, run, examples, run.sampler_config(cfg.eval.sampler if sampler is None else sampler),
                      key=key, mesh=mesh)
    samples = tuple(Sample(e.prompt, e.answer, t, r) for e, t, r in
                    zip(examples[:cfg.eval.samples_shown], decoded.texts, decoded.rewards.tolist()))
    canvas, trace = cfg.canvas, decoded.first_trace
    picture = trace_png(
        committed=trace.committed, tokens=trace.tokens, step_valid=trace.step_valid, block_ids=trace.block_ids,
        first_block=canvas.prompt_len // canvas.block_size, num_blocks=canvas.max_new_tokens // canvas.block_size,
        block_size=canvas.block_size, token_text=trace_text(run.tokenizer),
        title=f"{title} denoising of {examples[0].prompt!r}".strip(),
    )
    rewards = decoded.rewards
    return Evaluation(accuracy=float(np.mean(rewards == 1.0)), mean_reward=float(np.mean(rewards)),
                      n=int(len(rewards)), nfe_per_token=decoded.nfe_per_token,
                      generated_tokens=float(np.mean(decoded.generated)), samples=samples, trace_png=picture,
                      rewards=tuple(rewards.tolist()))


def _pass_at_k(correct: np.ndarray, samples: int) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... ≤ `samples`, averaged over the problems, from each problem's
    count of correct rollouts among `samples`."""
    ks = [k for k in (2 ** i for i in range(samples.bit_length())) if k <= samples]
    return {f"pass@{k}": float(np.mean([pass_at_k(samples, int(c), k) for c in correct])) for k in ks}


def _sampled(model: Any, run: Run, samples: int, *, key: jax.Array, mesh: jax.sharding.Mesh | None,
             sampler: SamplerSection | None = None, logprobs: bool = False) -> _Decoded:
    """`samples` rollouts of every eval problem at `sampler` (default `[grpo] sampler`), rows
    problem by problem."""
    repeated = [e for e in eval_examples(run) for _ in range(samples)]
    section = run.config.grpo.sampler if sampler is None else sampler
    return _decode(model, run, repeated, run.sampler_config(section), key=key, mesh=mesh, logprobs=logprobs)


def sampled_correct(model: Any, run: Run, samples: int, *, key: jax.Array,
                    mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    """How many of `samples` rollouts per eval problem (at `[grpo] sampler`) were correct."""
    decoded = _sampled(model, run, samples, key=key, mesh=mesh)
    return (decoded.rewards.reshape(-1, samples) == 1.0).sum(axis=1)


def best_of(model: Any, run: Run, n: int, rules: Sequence[str] = ("logprob", "vote"), *, key: jax.Array,
            mesh: jax.sharding.Mesh | None = None, sampler: SamplerSection | None = None) -> tuple[BestOfN, ...]:
    """Best-of-`n` by each rule over `n` rollouts of every eval problem at `sampler` (default
    `[grpo] sampler`, as pass@k), with pass@n and the NFE per problem (`_best_of`)."""
    decoded = _sampled(model, run, n, key=key, mesh=mesh, sampler=sampler, logprobs=True)
    return _best_of_decoded(decoded, n, rules)


def _best_of_decoded(decoded: _Decoded, n: int, rules: Sequence[str]) -> tuple[BestOfN, ...]:
    assert decoded.logprobs is not None
    return best_of_n(decoded.rewards.reshape(-1, n), decoded.texts, decoded.logprobs.reshape(-1, n),
                     decoded.nfe, rules)


def decoding_settings(sampler: SamplerSection, thresholds: Sequence[float]) -> list[tuple[str, SamplerSection]]:
    """The accuracy-vs-NFE settings: `sampler` at each confidence threshold, then one token per step
    (the most confident position: a threshold no confidence reaches, which commits what `steps` at
    one per step does, in the same compiled program as the thresholds)."""
    settings = [(f"τ {t}", dataclasses.replace(sampler, strategy="threshold", threshold=t, steps_per_block=None))
                for t in thresholds]
    settings.append((ONE_PER_STEP, dataclasses.replace(sampler, strategy="threshold", threshold=math.inf,
                                                       steps_per_block=None, max_steps_per_block=None)))
    return settings


def accuracy_vs_nfe(model: Any, run: Run, thresholds: Sequence[float], *, key: jax.Array,
                    mesh: jax.sharding.Mesh | None = None, timed: bool = False,
                    known: Evaluation | None = None) -> tuple[NFEPoint, ...]:
    """`[eval] sampler` at each threshold and at one token per step. `timed`: time each setting's
    decoding once its program is compiled (a first, untimed pass per program: the threshold is
    traced, so every setting here shares one), for generated tokens per second. `known`: the
    `[eval] sampler`'s own evaluation with the same key, reused (untimed) where a setting is it."""
    examples, points, compiled = eval_examples(run), [], set()
    for label, section in decoding_settings(run.config.eval.sampler, thresholds):
        if known is not None and not timed and section == run.config.eval.sampler:
            points.append(NFEPoint(label, known.accuracy, known.mean_reward, known.nfe_per_token))
            continue
        sampler = run.sampler_config(section)
        program = dataclasses.replace(section, threshold=0.0)  # what the compiled program depends on
        if timed and program not in compiled:
            _decode(model, run, examples, sampler, key=key, mesh=mesh)
            compiled.add(program)
        start = time.perf_counter()
        decoded = _decode(model, run, examples, sampler, key=key, mesh=mesh)
        seconds = time.perf_counter() - start
        points.append(NFEPoint(label, float(np.mean(decoded.rewards == 1.0)), float(np.mean(decoded.rewards)),
                               decoded.nfe_per_token,
                               float(np.sum(decoded.generated) / seconds) if timed else None))
    return tuple(points)


def evaluate_report(model: Any, run: Run, *, key: jax.Array, title: str = "", mesh: jax.sharding.Mesh | None = None,
                    samples: int | None = None, thresholds: Sequence[float] | None = None,
                    timed: bool = False, best_of: Sequence[str] | None = None) -> Evaluation:
    """`evaluate`, plus pass@k over `samples` (default `[eval] samples`; 0: none) rollouts per
    problem, best-of-n over those rollouts by each of `best_of`'s rules (default `[eval] best_of`)
    and the accuracy-vs-NFE curve over `thresholds` (default `[eval] thresholds`; empty: none)
    with its picture."""
    section = run.config.eval
    samples = section.samples if samples is None else samples
    thresholds = section.thresholds if thresholds is None else thresholds
    rules = section.best_of if best_of is None else best_of
    greedy = evaluate(model, run, key=key, title=title, mesh=mesh)
    decoded = _sampled(model, run, samples, key=key, mesh=mesh, logprobs=bool(rules)) if samples else None
    correct = np.zeros(0, np.int64) if decoded is None else (decoded.rewards.reshape(-1, samples) == 1.0).sum(axis=1)
    best = () if decoded is None or not rules else _best_of_decoded(decoded, samples, rules)
    curve = accuracy_vs_nfe(model, run, thresholds, key=key, mesh=mesh, timed=timed, known=greedy) if thresholds else ()
    picture = accuracy_nfe_png({title or "model": [dataclasses.asdict(p) for p in curve]},
                               title=f"{title} accuracy vs NFE".strip()) if curve else None
    return dataclasses.replace(greedy, pass_at_k=_pass_at_k(correct, samples) if samples else {},
                               samples_per_problem=samples, accuracy_vs_nfe=curve, curve_png=picture,
                               correct_samples=tuple(int(c) for c in correct), best_of=best)
