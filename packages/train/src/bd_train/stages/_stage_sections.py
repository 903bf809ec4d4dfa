"""The preset's sections about training stages: `[*.optim]`, `[*.sampler]`, `[sft]`, `[opd]`,
`[grpo]`, `[rft]` and `[eval]`. `PipelineConfig` (`_config`) composes them."""

from __future__ import annotations

import dataclasses
from typing import Literal

from bd_core import ConfigError, config_error
from bd_data import CanvasConfig, CorruptionConfig
from bd_models import SamplerConfig, SamplingDistribution


# Section invariants name the field relative to the section; `build` prefixes the section's path.
def _positive(**values: float | int) -> None:
    for name, value in values.items():
        if not value > 0:
            raise config_error("", name, value, "a value > 0")


def _nonneg(**values: float | int) -> None:
    for name, value in values.items():
        if value < 0:
            raise config_error("", name, value, "a value >= 0")


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warmup then `schedule` decay over the stage's steps, global-norm clipping.

    `eps` is Adam's epsilon (added to the root of the second moment): where it is well above a
    parameter's gradient RMS, Adam's step for that parameter is the gradient times lr / eps, as
    in SGD, instead of a unit-sized step whatever the gradient's size.

    Attributes:
        lr: the peak learning rate (> 0).
        warmup_steps: steps of linear warmup from 0 to `lr` (>= 0).
        schedule: after warmup: `constant`, or `cosine` / `linear` decay over the stage's remaining steps.
        weight_decay: AdamW's decoupled weight decay (>= 0), on every weight but the RMSNorm gains.
        clip_norm: the global gradient norm is clipped to this (> 0).
        b2: Adam's second-moment decay, in [0, 1).
        eps: Adam's epsilon (see above; > 0).
    """

    lr: float = 3e-3
    warmup_steps: int = 20
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b2: float = 0.99
    eps: float = 1e-8

    def __post_init__(self):
        _positive(lr=self.lr, clip_norm=self.clip_norm, eps=self.eps)
        _nonneg(warmup_steps=self.warmup_steps, weight_decay=self.weight_decay)
        if not 0 <= self.b2 < 1:
            raise config_error("", "b2", self.b2, "a decay in [0, 1)", "e.g. 0.99 or 0.999")


@dataclasses.dataclass(frozen=True)
class SamplerSection:
    """Rollout/eval decoding (lengths, mask/pad and stop ids follow the canvas and tokenizer).

    Attributes:
        temperature: the sampling temperature: 0 (greedy; refused in `[grpo.sampler]`) or at least 1e-6.
        top_k: sample among the k most likely tokens only (an int >= 1, at most the vocabulary; unset: all).
        top_p: sample within the smallest set of tokens of total probability p, in (0, 1] (unset: all).
        strategy: which masked positions commit per step: `threshold` (every one whose confidence reaches
            `threshold`), `steps` (a fixed number per step), or `random` (as many as `steps`, chosen at random: the
            trajectory's likelihood is exact).
        threshold: τ, the confidence at which `threshold` commits a position (at least one commits per step;
            >= 0, above 1 commits one position per step).
        steps_per_block: denoising steps per block for `steps` and `random` only, 1 to the block size (default: one
            token per step).
        max_steps_per_block: a cap on `threshold`'s steps per block, for `threshold` only, 1 to the block size
            (default: the block size).
        confidence: what `threshold` compares with τ: the sampled token's `probability`, the top-1 minus top-2
            `margin`, or `entropy` as exp(-H).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    strategy: Literal["threshold", "steps", "random"] = "threshold"  # "random": exact trajectory likelihood
    threshold: float = 0.9
    steps_per_block: int | None = None
    max_steps_per_block: int | None = None
    confidence: Literal["probability", "margin", "entropy"] = "probability"

    def sampler_config(self, canvas: CanvasConfig, *, mask_id: int, pad_id: int,
                       stop_ids: tuple[int, ...] = ()) -> SamplerConfig:
        """The `bd_models.SamplerConfig` of this table on `canvas`, with the tokenizer's ids. Its
        refusals name the table's key (`top_p: expected ...`)."""
        try:
            distribution = SamplingDistribution(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            return SamplerConfig(block_size=canvas.block_size, max_new_tokens=canvas.max_new_tokens, mask_id=mask_id,
                                 pad_id=pad_id, distribution=distribution, strategy=self.strategy,
                                 threshold=self.threshold, steps_per_block=self.steps_per_block,
                                 max_steps_per_block=self.max_steps_per_block, confidence=self.confidence,
                                 stop_ids=stop_ids)
        except ConfigError as err:
            raise ConfigError(str(err).removeprefix("SamplingDistribution.").removeprefix("SamplerConfig.")) from None


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised masked-diffusion fine-tuning of the teacher and the student: each completion block is masked at a
    random noise level and the model learns to fill it in.

    Attributes:
        steps: optimizer updates of the student (and of the teacher, unless `teacher_steps` is set).
        batch_size: sequences per update; each microbatch's rows (batch_size / microbatches) must split evenly
            over the mesh's data x fsdp devices.
        microbatches: parts each batch is split into and accumulated exactly inside one update (to fit memory).
        teacher_steps: the teacher's updates when it should train longer than the student (unset: `steps`).
        optim: the optimizer (`[sft.optim]`).
        corruption: the masking noise and loss weighting (`[sft.corruption]`).
    """

    steps: int = 600
    batch_size: int = 128
    microbatches: int = 1
    teacher_steps: int | None = None  # the teacher may train longer than the student
    optim: OptimSection = OptimSection()
    corruption: CorruptionConfig = CorruptionConfig()

    def __post_init__(self):
        _positive(steps=self.steps, batch_size=self.batch_size, microbatches=self.microbatches)
        if self.teacher_steps is not None:
            _positive(teacher_steps=self.teacher_steps)
        if self.batch_size % self.microbatches:
            raise ConfigError(f"microbatches: {self.microbatches} does not divide batch_size={self.batch_size}")

    def steps_for(self, role: str) -> int:
        return self.teacher_steps if role == "teacher" and self.teacher_steps else self.steps


@dataclasses.dataclass(frozen=True)
class OPDSection:
    """`microbatches` splits each step's rollouts into that many parts accumulated inside the one
    update (exact, as in SFT): a large model's replay logits need not fit at once. `guard` is
    what follows when the held-out problems show the teacher no better than the student before
    OPD, or the student worse than where OPD started during or after it (`_guard`).

    Attributes:
        steps: distillation updates.
        prompts_per_step: prompts the student samples a completion for per update.
        microbatches: parts each step's rollouts are split into (see above).
        kl_temperature: softens both distributions in the KL (the loss is scaled by T² so gradients keep their
            size).
        hard_ce_weight: weight of an added cross-entropy to the tokens the student committed (0: off; needs
            `positions = "committed"`).
        positions: where the KL is taken: every `masked` position of a replayed view, or only the `committed` ones.
        optim: the optimizer (`[opd.optim]`).
        sampler: how the student samples its rollouts (`[opd.sampler]`).
        guard: what a paired held-out comparison that finds OPD harmful does: "keep-best" hands the next
            stage OPD's start when OPD ends worse than it began, "warn" only says so, "stop" stops the run.
    """

    steps: int = 100
    prompts_per_step: int = 64
    microbatches: int = 1
    kl_temperature: float = 1.0
    hard_ce_weight: float = 0.0
    positions: Literal["committed", "masked"] = "masked"
    # "keep-best" by default: a pipeline whose result is its student should not hand on one that
    # distillation made measurably worse; it costs one greedy held-out evaluation per checkpoint.
    guard: Literal["keep-best", "warn", "stop"] = "keep-best"
    optim: OptimSection = OptimSection(lr=1e-3, warmup_steps=5)
    sampler: SamplerSection = SamplerSection(temperature=1.0)

    def __post_init__(self):
        _positive(steps=self.steps, prompts_per_step=self.prompts_per_step, kl_temperature=self.kl_temperature,
                  microbatches=self.microbatches)
        _nonneg(hard_ce_weight=self.hard_ce_weight)
        if self.prompts_per_step % self.microbatches:
            raise ConfigError(f"microbatches: {self.microbatches} does not divide prompts_per_step="
                              f"{self.prompts_per_step}")
        if self.hard_ce_weight > 0 and self.positions != "committed":
            raise ConfigError("hard_ce_weight: hard CE needs a target at each distilled position, and a replayed "
                              "view knows only the tokens committed in it; set positions = 'committed' or "
                              "hard_ce_weight = 0")


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """`microbatches` splits each update's prompts_per_step x group_size rows into that many
    parts accumulated inside the one update (exact).

    Attributes:
        steps: rollouts; each is followed by `updates_per_rollout` updates.
        prompts_per_step: prompts per rollout.
        group_size: samples per prompt, compared with each other for the advantages (>= 2).
        updates_per_rollout: optimizer updates on each rollout (the first's importance ratio is 1 to float
            tolerance: the replay scores the distribution the rollout sampled).
        microbatches: parts each update's rows are split into (see above).
        advantage: `grpo` (reward minus the group mean, over the group's std), `drgrpo` (minus the mean, no std) or
            `rloo` (minus the mean of the others).
        aggregation: how token losses combine: `token-mean`, `seq-mean-token-mean`, or `seq-mean-token-sum-norm`
            (Dr. GRPO).
        ratio: the importance ratio per `token`, or per sequence (`gspo-token`: GSPO's geometric mean, with per-
            token gradients).
        epsilon_low: the ratio is clipped below at 1 − epsilon_low, in [0, 1).
        epsilon_high: the ratio is clipped above at 1 + epsilon_high, >= 0 (above `epsilon_low`: DAPO's clip-higher).
        beta: weight of the k3 KL to the starting model (0: off, no reference forward), both scored at the
            sampler's temperature without its top-k or top-p (under the filters the log-ratio can be infinite).
        optim: the optimizer (`[grpo.optim]`).
        sampler: how rollouts are sampled (`[grpo.sampler]`); pass@k in evaluation uses it too.
    """

    steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 8
    updates_per_rollout: int = 2
    microbatches: int = 1
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    ratio: Literal["token", "gspo-token"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    optim: OptimSection = OptimSection(lr=5e-4, warmup_steps=0)
    sampler: SamplerSection = SamplerSection(temperature=1.0)

    def __post_init__(self):
        _positive(steps=self.steps, prompts_per_step=self.prompts_per_step,
                  updates_per_rollout=self.updates_per_rollout, microbatches=self.microbatches)
        if (self.prompts_per_step * self.group_size) % self.microbatches:
            raise ConfigError(f"microbatches: {self.microbatches} does not divide the update's prompts_per_step x "
                              f"group_size = {self.prompts_per_step * self.group_size} rows")
        if self.group_size < 2:
            raise config_error("", "group_size", self.group_size, ">= 2",
                               "advantages compare the samples of one prompt")
        _nonneg(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=self.beta)
        if self.sampler.temperature == 0:
            raise config_error("", "sampler.temperature", 0, "> 0 (e.g. 1.0)",
                               "greedy rollouts have log-probs that do not depend on the weights, so GRPO's "
                               "gradient is 0 and every sample of a prompt is the same")
        if not self.epsilon_low < 1:
            raise config_error("", "epsilon_low", self.epsilon_low, "a value in [0, 1)",
                               "the ratio is clipped below at 1 - epsilon_low; use e.g. 0.2")


@dataclasses.dataclass(frozen=True)
class RFTSection:
    """Rejection-sampling fine-tuning (`run_rft`, STaR/RFT): each of `steps` rounds samples
    `group_size` completions of each of `prompts_per_step` prompts from the current model, keeps
    those whose verifier reward is at least `min_reward`, and takes `updates_per_rollout` SFT
    updates on them. `microbatches` splits each update's prompts_per_step x group_size rows into
    that many parts accumulated inside the one update (exact). Only `bd_train.stages.run_rft` reads
    this table (the GRPO study's control); the flow, `make run` and `make stages` run SFT, OPD and GRPO.

    Attributes:
        steps: rounds; each samples afresh from the model as it then is.
        prompts_per_step: training prompts sampled per round.
        group_size: completions sampled per prompt.
        updates_per_rollout: SFT updates per round on its accepted completions, each with fresh masks.
        microbatches: parts each update's rows are split into (see above).
        min_reward: a completion is kept when its verifier reward is at least this, in [0, 1]; 1.0, every task's full
            credit, keeps the verified-correct ones (0 would keep every sample: self-distillation).
        optim: the optimizer (`[rft.optim]`).
        sampler: the rollout decoding (`[rft.sampler]`), as `[grpo] sampler`.
        corruption: the masking of the kept completions (`[rft.corruption]`), as `[sft] corruption`.
    """

    steps: int = 40  # rounds: each samples afresh from the model as it then is
    prompts_per_step: int = 16  # training prompts sampled per round
    group_size: int = 8  # completions sampled per prompt
    updates_per_rollout: int = 1  # SFT updates per round on its accepted completions, each with fresh masks
    microbatches: int = 1
    # A completion is kept when its verifier reward is at least this; 1.0, every task's full
    # credit, keeps the verified-correct ones (0 would keep every sample: self-distillation).
    min_reward: float = 1.0
    optim: OptimSection = OptimSection(lr=1e-3, warmup_steps=5)  # a starting point, not a measured optimum
    sampler: SamplerSection = SamplerSection(temperature=1.0)  # the rollout decoding, as [grpo] sampler
    corruption: CorruptionConfig = CorruptionConfig()  # the masking of the kept completions, as [sft] corruption

    def __post_init__(self):
        _positive(steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                  updates_per_rollout=self.updates_per_rollout, microbatches=self.microbatches)
        if (self.prompts_per_step * self.group_size) % self.microbatches:
            raise ConfigError(f"microbatches: {self.microbatches} does not divide the update's prompts_per_step x "
                              f"group_size = {self.prompts_per_step * self.group_size} rows")
        if not 0.0 <= self.min_reward <= 1.0:
            raise config_error("", "min_reward", self.min_reward, "a reward in [0, 1]",
                               "1.0 keeps the verified-correct completions")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """The held-out evaluation every stage ends with, on problems never seen in training.

    Attributes:
        n: held-out problems.
        batch_size: problems decoded at once.
        samples_shown: sample completions the cards and W&B show.
        sampler: the decoding of the accuracy table (`[eval.sampler]`; greedy by default).
        samples: rollouts per problem for pass@k at the `[grpo] sampler` decoding (0: off).
        thresholds: confidence thresholds in (0, 1] of the accuracy-against-NFE curve, then one token per step (`[]`:
            off).
        best_of: best-of-n over the pass@k samples, chosen without the answer: `"logprob"` (the sample the
            model is most confident in, by its trace's log-probs) and/or `"vote"` (the most frequent answer).
    """

    n: int = 256
    batch_size: int = 256
    samples_shown: int = 8
    sampler: SamplerSection = SamplerSection(temperature=0.0)
    # pass@k for k = 1, 2, 4, ... <= samples, from `samples` rollouts per problem at the rollout
    # decoding ([grpo] sampler); 0 turns it off.
    samples: int = 4
    # The accuracy-vs-NFE curve: [eval] sampler at each confidence threshold, then one token per
    # step; [] turns it off.
    thresholds: tuple[float, ...] = (0.5, 0.7, 0.9, 0.95)
    # Best-of-n with n = samples: of the pass@k rollouts of each problem, the one these rules pick
    # without the reference answer ("logprob": the largest sum of its tokens' log-probs in the
    # exact trace; "vote": the most frequent completion) is scored; pass@n is its upper bound.
    best_of: tuple[Literal["logprob", "vote"], ...] = ()

    def __post_init__(self):
        _positive(n=self.n, batch_size=self.batch_size)
        _nonneg(samples=self.samples)
        if len(set(self.best_of)) != len(self.best_of):
            raise config_error("", "best_of", list(self.best_of), "distinct rules from ['logprob', 'vote']")
        if self.best_of and not self.samples:
            raise config_error("", "best_of", list(self.best_of), "no rules while samples = 0",
                               "best-of-n picks among the `samples` rollouts of each problem; set samples >= 1")
        for t in self.thresholds:
            if not 0.0 < t <= 1.0:
                raise config_error("", "thresholds", list(self.thresholds), "confidence thresholds in (0, 1]")
