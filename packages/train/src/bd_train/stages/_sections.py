"""The preset's sections about data and models: `[task]`, `[tokenizer]`, `[teacher]` and
`[student]` (with their `[*.lora]`), `[mesh]`; and the invariant checks every section uses.
`PipelineConfig` (`_config`) composes them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Literal

from bd_core import ConfigError, PretrainedSource, config_error, resolve_pretrained

_WEIGHTS = contextvars.ContextVar("weights", default=True)


@contextlib.contextmanager
def shapes_only():
    """Within it, a Hub repo id in `pretrained` fetches its config and tokenizer files only, not its
    weights: what an ahead-of-time plan reads (`bd_train.plan`)."""
    token = _WEIGHTS.set(False)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


def _resolve(ref: str, revision: str | None) -> PretrainedSource:
    """A pretrained checkpoint's files, resolved once per process and Hub cache (a Hub id may
    download; a branch that moves later is not followed within a run)."""
    return _resolve_in(ref, revision, _WEIGHTS.get(), os.environ.get("HF_HUB_CACHE"), os.environ.get("HF_HOME"))


@functools.cache
def _resolve_in(ref: str, revision: str | None, weights: bool, *cache: str | None) -> PretrainedSource:
    return resolve_pretrained(ref, revision, weights=weights)


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """A built-in task (`name` + `params`) or the user's JSONL files (`train_jsonl`, `eval_jsonl`);
    `chat_template` renders every prompt as a user turn of a chat template (`true`: the
    tokenizer's own; or a Jinja file's path).

    Attributes:
        name: a built-in task (`sort`, `argsort`, `addition`, `addition_lsd`, `countdown`, `mini_sudoku`,
            `chain_sum`, `math`); unused beside JSONL files (theirs are rewarded by exact match: for math-verify
            rewards on your file, use `math` with its `path`), as the run says at the start.
        params: the task's own parameters, e.g. `{ length = 6 }` for argsort or `{ max_numbers = 3 }` for countdown:
            the attributes of its class in `bd_data` (`SortTask`, `ArgsortTask`, `AdditionTask`, `CountdownTask`,
            `MiniSudokuTask`, `ChainSumTask`, `MathTask`; `bd_data.get_task`).
        seed: the seed a generated task draws its problems from; a different seed gives different train and eval
            problems (`math` and JSONL files read theirs in file order, whatever the seed; `[run] seed` seeds
            everything else).
        train_jsonl: a JSONL file of `{"prompt": ..., "completion": ...}` objects to train on (with `eval_jsonl`).
        eval_jsonl: the held-out JSONL file every stage evaluates on (with `train_jsonl`).
        overlong: what to do with a JSONL example longer than the canvas: `error` stops naming it, `truncate` cuts
            it to fit, `skip` drops it; what was cut or dropped is said at the start. Unused with a built-in task
            (said at the start), whose problems must each fit: the first 512 training problems of a generated task,
            and every problem of a file's, are checked at the start.
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
    # true = the tokenizer's own (a chat_template.jinja file beside its tokenizer.json if there is
    # one, else the `chat_template` of the tokenizer_config.json there), or the path of a Jinja file.
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
                what = "is a folder" if Path(path).is_dir() else "does not exist"
                raise ConfigError(f"{name}: file {path!r} {what}; give the path of a JSONL file "
                                  f"with one {{\"prompt\": ..., \"completion\": ...}} object per line")
        if (self.train_jsonl is None) != (self.eval_jsonl is None):
            raise ConfigError("train_jsonl / eval_jsonl: give both (training and held-out data) or neither")


@dataclasses.dataclass(frozen=True)
class TokenizerSection:
    """The byte-level tokenizer (default), a local HF `tokenizer.json`, or (no `path`, a pretrained
    model) the checkpoint's own `tokenizer.json`. `mask_token` / `eos_token` default to those its
    `tokenizer_config.json` names (or, where it names none, its `special_tokens_map.json`), else
    `<|mask|>` / `<|endoftext|>`; `add_mask_token` adds a
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
        checkpoint: an SFT stage's checkpoint folder to adopt instead of training this role (another stage's
            is adopted as it is, with a warning at the start naming the stage that wrote it).
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
        if self.logits_chunk < 0:  # invariants name the field relative to the section
            raise config_error("", "logits_chunk", self.logits_chunk, "a value >= 0")
        if self.pretrained is None and self.checkpoint is None:  # the sizes build the model: checked now
            from bd_models import ModelConfig

            try:  # the vocabulary and block come from the tokenizer and canvas; stand-ins do for the sizes
                ModelConfig(vocab_size=256, block_size=1, **self.model_kwargs())
            except ConfigError as err:  # `head_dim` is the checkpoint's, not a preset key
                raise ConfigError(str(err).removeprefix("ModelConfig.").replace(", or set head_dim", "")) from None
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
        for name in ("data", "fsdp", "model", "num_nodes"):
            if not getattr(self, name) > 0:
                raise config_error("", name, getattr(self, name), "a value > 0")
        if self.devices % self.num_nodes:
            raise ConfigError(f"num_nodes: {self.num_nodes} nodes cannot split data*fsdp*model = {self.devices} "
                              f"devices evenly; make the device count a multiple of num_nodes")

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.model
