"""The pipeline's run config: one frozen dataclass per component, composed into `PipelineConfig`.

A preset TOML has one table per field of `PipelineConfig`; unknown keys, wrong types and broken
invariants fail on load with the key named. Model sizes come without vocab and block size: those
follow the tokenizer and the canvas, so teacher and student agree on them by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Literal

from bd_core import ConfigError, PretrainedSource, config_error, resolve_pretrained
from bd_data import CanvasConfig, ChatTemplate, ChatTemplateError, CorruptionConfig, load_chat_template

from ._config_io import build, to_dict


def _resolve(ref: str, revision: str | None) -> PretrainedSource:
    """A pretrained checkpoint's files, resolved once per process and Hub cache (a Hub id may
    download; a branch that moves later is not followed within a run)."""
    return _resolve_in(ref, revision, os.environ.get("HF_HUB_CACHE"), os.environ.get("HF_HOME"))


@functools.cache
def _resolve_in(ref: str, revision: str | None, *cache: str | None) -> PretrainedSource:
    return resolve_pretrained(ref, revision)


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
class TaskSection:
    """A built-in task (`name` + `params`) or the user's JSONL files (`train_jsonl`, `eval_jsonl`);
    `chat_template` renders every prompt as a user turn of a chat template (`true`: the
    tokenizer's own; or a Jinja file's path).

    Attributes:
        name: a built-in task (`sort`, `argsort`, `addition`, `addition_lsd`, `countdown`, `mini_sudoku`,
            `chain_sum`, `math`), ignored with JSONL files.
        params: the task's own parameters, e.g. `{ length = 6 }` for argsort or `{ max_numbers = 3 }` for countdown
            (`bd_data.get_task`).
        seed: the seed the task draws its problems from; a different seed gives different train and eval problems
            (`[run] seed` seeds everything else).
        train_jsonl: a JSONL file of `{"prompt": ..., "completion": ...}` objects to train on (with `eval_jsonl`).
        eval_jsonl: the held-out JSONL file every stage evaluates on (with `train_jsonl`).
        overlong: what to do with an example longer than the canvas: `error` stops naming it, `truncate` cuts it to
            fit, `skip` drops it.
        chat_template: render every prompt as a user turn of a chat template: `true` for the tokenizer's own, a
            Jinja file's path, or `false`.
    """

    name: str = "argsort"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    train_jsonl: str | None = None
    eval_jsonl: str | None = None
    overlong: Literal["error", "truncate", "skip"] = "error"
    # Render every prompt (SFT, OPD, GRPO, evaluation) as a user turn through a chat template:
    # true = the tokenizer's own (the `chat_template` of the tokenizer_config.json beside its
    # tokenizer.json, or a chat_template.jinja file there), or the path of a Jinja template file.
    # The template's markup becomes special tokens; the prompt stays text. Its text is pinned in
    # the stages' checkpoints (training.chat_template).
    chat_template: bool | str = False

    def __post_init__(self):
        if isinstance(self.chat_template, str) and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat_template: file {self.chat_template!r} does not exist; give the path of a Jinja "
                              f"chat template file, true for the tokenizer's own template, or false")
        for name in ("train_jsonl", "eval_jsonl"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: file {path!r} does not exist; give the path of a JSONL file "
                                  f"with one {{\"prompt\": ..., \"completion\": ...}} object per line")
        if (self.train_jsonl is None) != (self.eval_jsonl is None):
            raise ConfigError("train_jsonl / eval_jsonl: give both (training and held-out data) or neither")


@dataclasses.dataclass(frozen=True)
class TokenizerSection:
    """The byte-level tokenizer (default), a local HF `tokenizer.json`, or (no `path`, a pretrained
    model) the checkpoint's own `tokenizer.json`. `mask_token` / `eos_token` default to those its
    `tokenizer_config.json` names, else `<|mask|>` / `<|endoftext|>`; `add_mask_token` adds a
    mask token the tokenizer lacks (an autoregressive checkpoint's), growing the embedding by a row
    initialized to the mean of the others.

    Attributes:
        path: a local `tokenizer.json` (Hugging Face `tokenizers`); unset: the byte tokenizer, or a pretrained
            model's own.
        mask_token: the token that marks a masked position (default: the one `tokenizer_config.json` names, else
            `<|mask|>`).
        eos_token: the token that ends a completion (default: the one `tokenizer_config.json` names, else
            `<|endoftext|>`).
        add_mask_token: add a mask token the tokenizer lacks, growing the embedding by a row initialized to the mean
            of the others.
    """

    path: str | None = None
    mask_token: str | None = None
    eos_token: str | None = None
    add_mask_token: bool = False

    def __post_init__(self):
        if self.path is not None and not Path(self.path).is_file():
            raise ConfigError(f"path: file {self.path!r} does not exist; give a local tokenizer.json "
                              f"or remove the key to use the byte tokenizer")


@dataclasses.dataclass(frozen=True)
class LoRASection:
    """LoRA adapters instead of full fine-tuning in the named `stages` (`bd_models.LoRAConfig`):
    each such stage freezes the model it starts from and trains fresh adapters on it (rank,
    alpha, the projections in `targets`, input `dropout` in SFT only); its checkpoints hold the
    adapters only, and the next stage starts from the merged model.

    Attributes:
        rank: the adapters' rank r.
        alpha: the scale numerator: an adapter's update is multiplied by alpha / rank.
        targets: the projections that get adapters (`wq`, `wk`, `wv`, `wo`, `w_gate`, `w_up`, `w_down`).
        dropout: dropout on the adapters' input, in SFT only (0: none).
        stages: the stages that train adapters instead of every weight.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    dropout: float = 0.0
    stages: tuple[Literal["sft", "opd", "grpo", "rft"], ...] = ("sft", "opd", "grpo", "rft")

    def __post_init__(self):
        try:  # validates rank, alpha, targets and dropout, naming the field
            self.lora_config()
        except ConfigError as err:
            raise ConfigError(str(err).removeprefix("LoRAConfig.")) from None
        if not self.stages or len(set(self.stages)) != len(self.stages):
            raise config_error("", "stages", list(self.stages), "distinct names from ['sft', 'opd', 'grpo', 'rft']")

    def lora_config(self):
        from bd_models import LoRAConfig

        return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=self.targets, dropout=self.dropout)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Architecture sizes; vocab and block size come from the tokenizer and canvas. `pretrained`
    starts from a Hugging Face checkpoint folder instead (config.json + safetensors: Qwen3, SDAR,
    Qwen2, Fast-dLLM v2, Llama), whose config sets the architecture (the sizes here are unused).

    Attributes:
        d_model: the width D.
        n_layers: the number of decoder layers.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention); unset: `n_heads`.
        d_ff: the SwiGLU MLP's hidden width; unset: 4 × `d_model`.
        attention: the attention implementation: `dense`, `blocked` (only the tiles the mask allows), `shard_map`,
            `pallas` (GPU kernels) or `splash` (TPU kernels).
        param_dtype: the dtype weights are stored and updated in.
        compute_dtype: the dtype of the forward pass's matmuls.
        remat: what the backward pass recomputes per layer: `elementwise` (cheap element-wise ops), `none`, `full`
            (the whole layer) or `save_matmuls`.
        logits_chunk: positions per row whose logits the losses compute at a time (recomputed in the backward
            pass), so the whole `[tokens, vocab]` logits are never held at once; 0: all at once.
        checkpoint: an SFT stage's checkpoint folder to adopt instead of training this role.
        pretrained: start from a Hugging Face checkpoint: a local folder, or a Hub repo id (`"org/name"`); its
            config sets the architecture.
        revision: with a Hub repo id: the branch, tag or commit (default `main`), pinned by its commit.
        lora: train LoRA adapters instead of every weight, in `lora.stages`.
    """

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    # `splash` (TPU's kernels) runs with tiles of 128, the others with bd_models' default of 64.
    attention: Literal["dense", "blocked", "shard_map", "pallas", "splash"] = "blocked"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # What the backward pass recomputes per layer (bd_models.ModelConfig.remat).
    remat: Literal["elementwise", "none", "full", "save_matmuls"] = "elementwise"
    # Positions per row whose logits the losses compute at a time, recomputed in the backward pass
    # (bd_models.ModelConfig.logits_chunk; 0: all at once).
    logits_chunk: int = 0
    checkpoint: str | None = None  # start from this SFT checkpoint folder instead of training
    # SFT starts from this Hugging Face checkpoint: a local folder, or a Hub repo id ("org/name")
    pretrained: str | None = None
    revision: str | None = None  # with a Hub repo id: the branch, tag or commit (default "main")
    lora: LoRASection | None = None  # train LoRA adapters instead of every weight (in lora.stages)

    def __post_init__(self):
        _nonneg(logits_chunk=self.logits_chunk)
        if self.checkpoint is not None and not Path(self.checkpoint).is_dir():
            raise ConfigError(f"checkpoint: folder {self.checkpoint!r} does not exist; give the checkpoint folder of "
                              f"an SFT stage (runs/pipeline/<run-id>/checkpoints/sft-<role>) or remove the key")
        if self.revision is not None and self.pretrained is None:
            raise ConfigError(f"revision: {self.revision!r} is given without pretrained; name the Hub repo "
                              "(pretrained = \"org/name\") or remove the key")
        if self.pretrained is not None:
            if self.checkpoint is not None:
                raise ConfigError("pretrained: give either checkpoint (adopt a finished SFT) or pretrained (train "
                                  "from a Hugging Face checkpoint), not both")
            from bd_models import model_config_from_hf, read_hf_config

            try:  # the folder (a Hub repo resolved through its cache), config.json and architecture, checked now
                folder = str(_resolve(self.pretrained, self.revision).folder)
                model_config_from_hf(read_hf_config(folder), block_size=1, where=str(Path(folder) / "config.json"))
            except ConfigError as err:
                raise ConfigError(f"pretrained: {err}") from None

    @property
    def source(self) -> PretrainedSource | None:
        """Where `pretrained`'s files are: the folder, or the Hub snapshot and its resolved commit."""
        return None if self.pretrained is None else _resolve(self.pretrained, self.revision)

    @property
    def folder(self) -> str | None:
        """The local folder `pretrained` names or resolves to (None without one)."""
        source = self.source
        return None if source is None else str(source.folder)

    def model_kwargs(self) -> dict[str, Any]:
        return dict(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads or self.n_heads, d_ff=self.d_ff or 4 * self.d_model,
                    attention=self.attention, param_dtype=self.param_dtype, compute_dtype=self.compute_dtype,
                    remat=self.remat, logits_chunk=self.logits_chunk, **self.tiles())

    def tiles(self) -> dict[str, int]:
        """The attention's query and key tiles where they differ from bd_models' default."""
        return {"q_tile": 128, "k_tile": 128} if self.attention == "splash" else {}


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The training mesh over every process's devices: `data` x `fsdp` x `model` devices in all,
    spread over `num_nodes` processes (Metaflow `@parallel` nodes, one per host).

    Attributes:
        data: devices along the data-parallel axis.
        fsdp: devices the parameters and optimizer state are sharded over (and the batch with them).
        model: devices along the tensor-parallel axis.
        num_nodes: processes (hosts) the devices are spread over; each runs the same stage.
    """

    data: int = 1
    fsdp: int = 1
    model: int = 1
    num_nodes: int = 1

    def __post_init__(self):
        _positive(data=self.data, fsdp=self.fsdp, model=self.model, num_nodes=self.num_nodes)
        if self.devices % self.num_nodes:
            raise ConfigError(f"num_nodes: {self.num_nodes} nodes cannot split data*fsdp*model = {self.devices} "
                              f"devices evenly; make the device count a multiple of num_nodes")

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.model


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warmup then `schedule` decay over the stage's steps, global-norm clipping.

    `eps` is Adam's epsilon (added to the root of the second moment): where it is well above a
    parameter's gradient RMS, Adam's step for that parameter is the gradient times lr / eps, as
    in SGD, instead of a unit-sized step whatever the gradient's size.

    Attributes:
        lr: the peak learning rate.
        warmup_steps: steps of linear warmup from 0 to `lr`.
        schedule: after warmup: `constant`, or `cosine` / `linear` decay over the stage's remaining steps.
        weight_decay: AdamW's decoupled weight decay.
        clip_norm: the global gradient norm is clipped to this.
        b2: Adam's second-moment decay.
        eps: Adam's epsilon (see above).
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


@dataclasses.dataclass(frozen=True)
class SamplerSection:
    """Rollout/eval decoding (lengths, mask/pad and stop ids follow the canvas and tokenizer).

    Attributes:
        temperature: the sampling temperature (0: greedy).
        top_k: sample among the k most likely tokens only (unset: all).
        top_p: sample within the smallest set of tokens of total probability p (unset: all).
        strategy: which masked positions commit per step: `threshold` (every one whose confidence reaches
            `threshold`), `steps` (a fixed number per step), or `random` (as many as `steps`, chosen at random: the
            trajectory's likelihood is exact).
        threshold: τ, the confidence at which `threshold` commits a position (at least one commits per step).
        steps_per_block: denoising steps per block for `steps` and `random` (default: one token per step).
        max_steps_per_block: a cap on `threshold`'s steps per block (default: the block size).
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


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised masked-diffusion fine-tuning of the teacher and the student: each completion block is masked at a
    random noise level and the model learns to fill it in.

    Attributes:
        steps: optimizer updates of the student (and of the teacher, unless `teacher_steps` is set).
        batch_size: sequences per update.
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
        group_size: samples per prompt, compared with each other for the advantages.
        updates_per_rollout: optimizer updates on each rollout (the first has importance ratio exactly 1).
        microbatches: parts each update's rows are split into (see above).
        advantage: `grpo` (reward minus the group mean, over the group's std), `drgrpo` (minus the mean, no std) or
            `rloo` (minus the mean of the others).
        aggregation: how token losses combine: `token-mean`, `seq-mean-token-mean`, or `seq-mean-token-sum-norm`
            (Dr. GRPO).
        ratio: the importance ratio per `token`, or per sequence (`gspo-token`: GSPO's geometric mean, with per-
            token gradients).
        epsilon_low: the ratio is clipped below at 1 − epsilon_low.
        epsilon_high: the ratio is clipped above at 1 + epsilon_high (above `epsilon_low`: DAPO's clip-higher).
        beta: weight of the k3 KL to the starting model (0: off, no reference forward).
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


@dataclasses.dataclass(frozen=True)
class RFTSection:
    """Rejection-sampling fine-tuning (`run_rft`, STaR/RFT): each of `steps` rounds samples
    `group_size` completions of each of `prompts_per_step` prompts from the current model, keeps
    those whose verifier reward is at least `min_reward`, and takes `updates_per_rollout` SFT
    updates on them. `microbatches` splits each update's prompts_per_step x group_size rows into
    that many parts accumulated inside the one update (exact).

    Attributes:
        steps: rounds; each samples afresh from the model as it then is.
        prompts_per_step: training prompts sampled per round.
        group_size: completions sampled per prompt.
        updates_per_rollout: SFT updates per round on its accepted completions, each with fresh masks.
        microbatches: parts each update's rows are split into (see above).
        min_reward: a completion is kept when its verifier reward is at least this; 1.0, every task's full
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
        thresholds: confidence thresholds of the accuracy-against-NFE curve, then one token per step (`[]`: off).
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


@dataclasses.dataclass(frozen=True)
class RunSection:
    """Seeds, folders, checkpoints, logging and the progress watchdog of the run.

    Attributes:
        seed: the seed of model initialization, data order and sampling in every stage (the task's problems follow
            `[task] seed`).
        output_dir: the folder for checkpoints, W&B runs, the compilation cache and `latest/summary.json`.
        project: the W&B project every stage's run is logged to.
        checkpoint_every: save every this many updates (and at the stage's end, and on SIGTERM).
        max_to_keep: checkpoints kept per stage.
        async_checkpoints: write periodic checkpoints on background threads while training goes on.
        log_every: log metrics every this many updates.
        export: also write each stage's model as a Hugging Face checkpoint (`<run>/export/<stage>`).
        allow_changes: fingerprint fields a resumed stage may find changed (e.g. `"training.grpo.optim.lr"`);
            anything else that differs is refused.
        stall_factor: a multi-process run stops (exit code 75) when an update takes longer than this × the median
            update (0: no watchdog).
        stall_floor_s: the least seconds without progress that count as a stall.
    """

    seed: int = 0
    output_dir: str = "runs"
    project: str = "bdlm"
    checkpoint_every: int = 100
    max_to_keep: int = 2
    # Periodic checkpoints are written (and their digests computed) on background threads while
    # training goes on; a step is committed, and listed for a resume, only once whole. The
    # stage's last save, and one on SIGTERM, still wait until committed. false: every save
    # stops training until it is written.
    async_checkpoints: bool = True
    log_every: int = 10
    export: bool = False  # also write each stage's model as a Hugging Face checkpoint (<run>/export/<stage>)
    # Fingerprint fields (e.g. "training.grpo.optim.lr", or a table: "training.grpo") that a
    # resumed stage may find changed; each accepted change is printed and recorded in the
    # checkpoints' `overrides`. Anything else that differs is refused by field name.
    allow_changes: tuple[str, ...] = ()
    # The progress watchdog of a multi-process run: an update loop (update or save) that makes no
    # progress for max(stall_factor x the median update time, stall_floor_s) dumps every thread's
    # stack into <run>/stacks/, names the slowest process and exits 75 (resume continues).
    # stall_factor = 0 turns it off; BDLM_STALL_FACTOR / BDLM_STALL_FLOOR_S override both.
    stall_factor: float = 10.0
    stall_floor_s: float = 300.0

    def __post_init__(self):
        if self.stall_factor != 0 and not self.stall_factor >= 2:
            raise config_error("", "stall_factor", self.stall_factor,
                               "0 (no watchdog) or at least 2 (an update may take twice the median on a busy host)")
        if not self.stall_floor_s >= 1:
            raise config_error("", "stall_floor_s", self.stall_floor_s, "at least 1 second")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The run config: one table per field, as a preset TOML writes them ([preset keys](presets.md) lists every key).

    Build it from TOML text with `parse_pipeline_config` then `pipeline_config`; unknown keys, wrong types and broken
    invariants are refused on load, naming the key.

    Attributes:
        task: the task and its data.
        tokenizer: the tokenizer and its special tokens.
        canvas: prompt length, completion length and block size.
        teacher: the teacher's architecture or checkpoint.
        student: the student's architecture or checkpoint.
        sft: supervised masked-diffusion fine-tuning of both roles.
        opd: on-policy distillation of the teacher into the student.
        grpo: GRPO on the task's reward.
        eval: the held-out evaluation each stage ends with.
        run: seeds, folders, checkpoints, logging and the progress watchdog.
        mesh: the device mesh and the number of nodes."""
    task: TaskSection = TaskSection()
    tokenizer: TokenizerSection = TokenizerSection()
    canvas: CanvasConfig = CanvasConfig()
    teacher: ModelSection = ModelSection(d_model=96, n_layers=3)
    student: ModelSection = ModelSection(d_model=48, n_layers=2)
    sft: SFTSection = SFTSection()
    opd: OPDSection = OPDSection()
    grpo: GRPOSection = GRPOSection()
    rft: RFTSection = RFTSection()
    eval: EvalSection = EvalSection()
    run: RunSection = RunSection()
    mesh: MeshSection = MeshSection()

    def __post_init__(self):
        folders = {role: getattr(self, role).folder for role in ("teacher", "student")}
        if self.tokenizer.path is None and all(folders.values()):
            files = [Path(f) / "tokenizer.json" for f in folders.values()]
            if all(f.is_file() for f in files) and files[0].read_bytes() != files[1].read_bytes():
                raise ConfigError(f"tokenizer.path: the teacher's {str(files[0])!r} and the student's "
                                  f"{str(files[1])!r} differ, and distillation needs one tokenizer; pick "
                                  f"checkpoints of one family, or set [tokenizer] path to the one both use")
        for role in ("teacher", "student"):
            section = getattr(self, role)
            lora = section.lora
            if lora is None:
                continue
            if role == "teacher" and "sft" not in lora.stages:
                raise ConfigError(f"teacher.lora.stages: {list(lora.stages)}; the teacher trains in 'sft' only, so "
                                  "stages must include 'sft' (or remove [teacher] lora)")
            if "sft" in lora.stages and section.checkpoint is None and section.pretrained is None:
                raise ConfigError(f"{role}.lora.stages: 'sft' trains adapters on the model SFT starts from, and the "
                                  f"{role} has no pretrained checkpoint (a random initialization is no base to adapt); "
                                  f"set [{role}] pretrained, or drop 'sft' from lora.stages")
            if "sft" in lora.stages and section.checkpoint is not None:
                raise ConfigError(f"{role}.lora.stages: 'sft' is listed but the {role} adopts the finished SFT "
                                  f"checkpoint {section.checkpoint!r} (nothing trains there); drop 'sft'")
        if self.task.chat_template is not False:
            try:
                self.chat_template()
            except ChatTemplateError as err:
                raise ConfigError(f"task.chat_template: {err}") from None
        if self.canvas.policy != "block_aligned":
            raise ConfigError("canvas.policy: the pipeline's rollouts (OPD, GRPO, eval) decode on the block-aligned "
                              "canvas; use policy = 'block_aligned' (the contiguous canvas is for bd_data's SFT "
                              "pipelines on their own)")

    @property
    def tokenizer_file(self) -> str | None:
        """The tokenizer.json in use: `[tokenizer] path`, else the pretrained student's (or
        teacher's) own; None for the byte tokenizer."""
        folders = [getattr(self, role).folder for role in ("student", "teacher")]
        return self.tokenizer.path or next((str(Path(f) / "tokenizer.json") for f in folders if f), None)

    def chat_template(self) -> ChatTemplate | None:
        """`[task] chat_template` loaded (`bd_data.ChatTemplate`), or None when it is off."""
        file = self.tokenizer_file
        return load_chat_template(self.task.chat_template, None if file is None else Path(file).parent)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain TOML-ready values (the form `parse_pipeline_config` returns)."""
        return to_dict(self)


def parse_pipeline_config(text: str | dict) -> dict[str, Any]:
    """Validate a preset (TOML text or a dict) and return its full plain form, defaults filled in."""
    import tomllib

    if isinstance(text, str):
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"the config is not valid TOML: {err}") from err
    else:
        data = dict(text)
    return build(PipelineConfig, data).to_dict()


def pipeline_config(data: Any) -> PipelineConfig:
    """The typed config from the plain form that `parse_pipeline_config` returned (or a Metaflow Config)."""
    if isinstance(data, PipelineConfig):
        return data
    return build(PipelineConfig, _plain(data))


def _plain(data: Any) -> Any:
    if hasattr(data, "items"):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data
