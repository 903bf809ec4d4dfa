"""The configs a pipeline run builds from its preset: each role's `ModelConfig` (the preset's sizes,
or a pretrained checkpoint's architecture), the samplers' and optimizers' configs, and the
persistent compilation cache (a mixin of `Run`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from bd_models import ModelConfig, SamplerConfig, model_config_from_hf, read_hf_config

from .._optim import OptimizerConfig

if TYPE_CHECKING:
    from ._config import PipelineConfig
    from ._run import RunDir
    from ._stage_sections import OptimSection, SamplerSection


class RunConfigs:
    """What `Run` builds from the preset's sections (its `config`, `tokenizer` and `where`)."""

    config: PipelineConfig
    tokenizer: Any
    where: RunDir

    def enable_compilation_cache(self) -> None:
        """A persistent JAX cache: Metaflow steps are separate processes compiling the same programs.
        It is `<output_dir>/jax_cache`, keeping programs that took 0.5 s or more to compile, unless
        the environment says otherwise in JAX's own variables (`JAX_COMPILATION_CACHE_DIR`, e.g. a
        cache every job of a cluster shares; `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`)."""
        if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            cache = self.where.outputs / "jax_cache"
            cache.mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", str(cache))
        if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    # -- configs -------------------------------------------------------------------------------------

    def model_config(self, role: str) -> ModelConfig:
        """The `ModelConfig` of `role`: the preset's sizes with the tokenizer's vocab and the canvas's block, or a
        pretrained checkpoint's architecture."""
        section = getattr(self.config, role)
        if section.pretrained:
            return model_config_from_hf(**self._pretrained_kwargs(role))
        return ModelConfig(vocab_size=self.tokenizer.vocab_size, block_size=self.config.canvas.block_size,
                           **section.model_kwargs())

    def _pretrained_kwargs(self, role: str) -> dict[str, Any]:
        """How a pretrained role's checkpoint is read: the canvas's block size, the vocabulary grown
        to the tokenizer's (an added mask token), the section's dtypes and execution fields."""
        section = getattr(self.config, role)
        raw = read_hf_config(section.folder)
        kwargs = section.model_kwargs()
        return dict(raw=raw, where=str(Path(section.folder) / "config.json"),
                    block_size=self.config.canvas.block_size,
                    vocab_size=max(int(raw.get("vocab_size", 0)), self.tokenizer.vocab_size),
                    **{k: kwargs[k] for k in ("param_dtype", "compute_dtype", "attention", "remat", "logits_chunk")},
                    **section.tiles())

    def sampler_config(self, section: SamplerSection) -> SamplerConfig:
        """The `SamplerConfig` of a `[... sampler]` table, with the canvas's lengths and the tokenizer's ids."""
        tok = self.tokenizer
        return section.sampler_config(self.config.canvas, mask_id=tok.mask_id, pad_id=tok.pad_id,
                                      stop_ids=(tok.eos_id,))

    @staticmethod
    def optimizer_config(section: OptimSection, steps: int) -> OptimizerConfig:
        """The `OptimizerConfig` of an `[... optim]` table for a stage of `steps` steps."""
        schedule = section.schedule if steps > section.warmup_steps else "constant"
        return OptimizerConfig(learning_rate=section.lr, schedule=schedule, warmup_steps=section.warmup_steps,
                               total_steps=steps if schedule != "constant" else None, b2=section.b2, eps=section.eps,
                               weight_decay=section.weight_decay, max_grad_norm=section.clip_norm)
