"""What every pipeline stage builds from the config: tokenizer, data, rewards, model and sampler
configs, identity fingerprints, the run folder, and the small result each stage hands on."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import jax
from bd_core import Fingerprint, FingerprintMismatch, require_compatible
from bd_data import ByteTokenizer, Example, HFTokenizer, get_task, load_jsonl
from bd_models import ModelConfig, SamplerConfig

from ._fingerprints import model_identity, rollout_semantics
from ._pipeline_config import OptimSection, PipelineConfig, SamplerSection, pipeline_config

ROLES = ("teacher", "student")
# Fields that must agree between a teacher and the student it distills into: everything about
# tokens and blocks, nothing about the architecture.
SHARED_IDENTITY_KEYS = ("tokenizer", "vocab_size", "mask_id", "pad_id", "eos_id", "block_size", "canvas_policy",
                        "prompt_len", "max_new_tokens", "alignment")


# How the model is computed, not what it computes (the implementations agree to float tolerance):
# a stage may change these without invalidating the checkpoint it starts from.
EXECUTION_FIELDS = ("attention", "q_tile", "k_tile", "remat")


class StageError(RuntimeError):
    """A stage refused to start or continue (mismatched checkpoint, missing file); nothing was lost."""


@dataclasses.dataclass(frozen=True)
class PipelineContext:
    """Where one pipeline run keeps its files; stable across `resume` (keyed by the origin run)."""

    run_id: str
    flow_name: str
    run_dir: str

    @classmethod
    def create(cls, config: Any, *, run_id: str, flow_name: str = "BDPipeline") -> PipelineContext:
        cfg = pipeline_config(config)
        run_dir = Path(cfg.run.output_dir).resolve() / "pipeline" / str(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls(str(run_id), flow_name, str(run_dir))

    def checkpoint_dir(self, stage: str) -> Path:
        return Path(self.run_dir) / "checkpoints" / stage

    @property
    def wandb_dir(self) -> Path:
        return Path(self.run_dir).parent.parent / "wandb"

    def enable_compilation_cache(self) -> None:
        """A persistent JAX cache: Metaflow steps are separate processes compiling the same programs."""
        cache = Path(self.run_dir).parent.parent / "jax_cache"
        cache.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class StageResult:
    """What a stage hands to the next one and to the summary: small values only."""

    stage: str
    role: str
    checkpoint_dir: str
    step: int
    identity: dict[str, Any]
    history: list[dict[str, float | int]]
    evaluation: dict[str, float]
    samples: list[dict[str, Any]]
    trace_png: bytes | None = None
    curves_png: bytes | None = None
    wandb_run_dir: str | None = None

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_json(self.identity)


class Setup:
    """The objects a stage needs, built once from the validated config."""

    def __init__(self, config: Any):
        self.config: PipelineConfig = pipeline_config(config)

    @cached_property
    def tokenizer(self):
        path = self.config.tokenizer.path
        return ByteTokenizer() if path is None else HFTokenizer(path)

    @cached_property
    def task(self):
        task = self.config.task
        return None if task.train_jsonl else get_task(task.name, seed=task.seed, **task.params)

    def source(self, split: str):
        task = self.config.task
        if task.train_jsonl:
            path = task.train_jsonl if split == "train" else task.eval_jsonl
            return load_jsonl(path, tokenizer=self.tokenizer, canvas=self.config.canvas, overlong=task.overlong)
        return self.task.dataset(split)

    def reward(self, example: Example, completion: str) -> float:
        if self.task is not None:
            return self.task.reward(example, completion)
        return 1.0 if completion.strip() == example.answer.strip() else 0.0  # user data: exact match

    def model_config(self, role: str) -> ModelConfig:
        section = getattr(self.config, role)
        return ModelConfig(vocab_size=self.tokenizer.vocab_size, block_size=self.config.canvas.block_size,
                           **section.model_kwargs())

    def sampler_config(self, section: SamplerSection) -> SamplerConfig:
        canvas, tok = self.config.canvas, self.tokenizer
        return SamplerConfig(
            block_size=canvas.block_size, max_new_tokens=canvas.max_new_tokens, mask_id=tok.mask_id,
            pad_id=tok.pad_id, temperature=section.temperature, top_k=section.top_k, top_p=section.top_p,
            strategy=section.strategy, threshold=section.threshold, steps_per_block=section.steps_per_block,
            max_steps_per_block=section.max_steps_per_block, confidence=section.confidence,
            stop_ids=(tok.eos_id,),
        )

    def optimizer_config(self, section: OptimSection, steps: int):
        from ._optim import OptimizerConfig

        schedule = section.schedule if steps > section.warmup_steps else "constant"
        return OptimizerConfig(learning_rate=section.lr, schedule=schedule, warmup_steps=section.warmup_steps,
                               total_steps=steps if schedule != "constant" else None, b2=section.b2,
                               weight_decay=section.weight_decay, max_grad_norm=section.clip_norm)

    def identity(self, role: str) -> Fingerprint:
        """Model identity: architecture (without how it is computed), tokenizer, special ids, block
        size, canvas and alignment."""
        tok, canvas = self.tokenizer, self.config.canvas
        architecture = {k: v for k, v in self.model_config(role).to_dict().items() if k not in EXECUTION_FIELDS}
        return model_identity(architecture, tokenizer=tok.identity, vocab_size=tok.vocab_size, mask_id=tok.mask_id,
                              block_size=canvas.block_size, canvas_policy=canvas.policy, alignment="target",
                              extra={"pad_id": tok.pad_id, "eos_id": tok.eos_id, "prompt_len": canvas.prompt_len,
                                     "max_new_tokens": canvas.max_new_tokens})

    def rollout_semantics(self, section: SamplerSection) -> Fingerprint:
        """What recorded traces mean: GRPO refuses to continue from traces sampled otherwise."""
        return rollout_semantics(self.sampler_config(section), prompt_len=self.config.canvas.prompt_len)


def check_distillation_pair(teacher: StageResult, student: StageResult) -> None:
    """Teacher and student must share tokens and blocks (not the architecture) to distill."""
    try:
        require_compatible(teacher.fingerprint, student.fingerprint, SHARED_IDENTITY_KEYS,
                           context=f"teacher checkpoint {teacher.checkpoint_dir} vs student")
    except FingerprintMismatch as err:
        raise StageError(f"{err}\nThe teacher must use the student's tokenizer, block size and canvas.") from None


def check_start_identity(saved: Fingerprint, expected: Fingerprint, *, what: str) -> None:
    try:
        require_compatible(saved, expected, context=what)
    except FingerprintMismatch as err:
        raise StageError(str(err)) from None


def progress(*, total: int, description: str):
    """A tqdm bar on a terminal. Elsewhere (Metaflow step logs, CI) a bar redrawn with carriage
    returns is one endless line, so tqdm prints a plain line every ~10% instead."""
    import sys

    from tqdm.auto import tqdm

    disable = os.environ.get("BDLM_PROGRESS", "1") == "0"
    if sys.stderr.isatty():
        return tqdm(total=total, desc=description, mininterval=1.0, dynamic_ncols=True, disable=disable)
    return tqdm(total=total, desc=description, mininterval=15.0, miniters=max(1, total // 10),
                ncols=100, ascii=True, disable=disable, file=_LineWriter(sys.stderr))


class _LineWriter:
    """Turns tqdm's carriage-return redraws into one line per update."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def trace_text(tokenizer) -> Callable[[int], str]:
    def text(token: int) -> str:
        if token == tokenizer.eos_id:
            return "⏎"
        decoded = tokenizer.decode([token], stop_at_eos=False)
        return decoded if decoded.isprintable() and decoded.strip() else "·"
    return text
