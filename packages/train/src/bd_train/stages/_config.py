"""The pipeline's run config: one frozen dataclass per component (`_sections`, `_stage_sections`,
and `RunSection` here), composed into `PipelineConfig`.

A preset TOML has one table per field of `PipelineConfig`; unknown keys, wrong types and broken
invariants fail on load with the key named. Model sizes come without vocab and block size: those
follow the tokenizer and the canvas, so teacher and student agree on them by construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import jax

from bd_core import ConfigError, config_error
from bd_data import CanvasConfig, ChatTemplate, ChatTemplateError, load_chat_template
from bd_models import ModelConfig

from ._config_io import build, to_dict
from ._sections import MeshSection, ModelSection, TaskSection, TokenizerSection
from ._stage_sections import EvalSection, GRPOSection, OPDSection, RFTSection, SFTSection

MATMUL_PRECISIONS = ("default", "high", "highest")


def matmul_precision(precision: str) -> contextlib.AbstractContextManager:
    """JAX's default matmul precision set to `precision` (`[run] matmul_precision`); "default"
    leaves JAX's own setting alone, so its programs are those of a run without the key."""
    return contextlib.nullcontext() if precision == "default" else jax.default_matmul_precision(precision)

# What a stage's checkpoints pin (`[run] allow_changes` names fields under these).
PINNED = ("identity", "training", "teacher", "teacher_weights", "rollout", "adapters", "start")


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
            update (0: no watchdog; otherwise at least 2).
        stall_floor_s: the least seconds without progress that count as a stall.
        matmul_precision: JAX's precision of float32 matrix products in every stage (`"default"`, `"high"` or
            `"highest"`); see `jax.default_matmul_precision`.
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
    # JAX's precision of float32 matrix products in every stage (jax.default_matmul_precision).
    # "default" is float32 on a CPU but passes them through bfloat16 on a TPU (TF32 on recent
    # GPUs): there a replay of a rollout's trace then differs from the log-probs the sampler
    # recorded by up to about 2% per token for a float32 model of random weights, against 8e-6
    # at "highest" (bench/trace_replay.py, BENCHMARKS.md), which computes float32 products in
    # several bfloat16 passes. bfloat16 compute rounds at bfloat16 whatever this says.
    matmul_precision: str = "default"

    def __post_init__(self):
        for name in ("checkpoint_every", "max_to_keep", "log_every"):
            if not getattr(self, name) >= 1:
                raise config_error("", name, getattr(self, name), "an integer >= 1",
                                   "max_to_keep = 0 would delete every checkpoint" if name == "max_to_keep" else None)
        for change in self.allow_changes:
            if change.split(".")[0] not in PINNED:
                raise config_error("", "allow_changes", change, f"a fingerprint field under one of {list(PINNED)}",
                                   'as a refused resume names it, e.g. "training.grpo.optim.lr"')
        if self.stall_factor != 0 and not self.stall_factor >= 2:
            raise config_error("", "stall_factor", self.stall_factor,
                               "0 (no watchdog) or at least 2 (an update may take twice the median on a busy host)")
        if not self.stall_floor_s >= 1:
            raise config_error("", "stall_floor_s", self.stall_floor_s, "at least 1 second")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise config_error("", "matmul_precision", self.matmul_precision, f"one of {list(MATMUL_PRECISIONS)}",
                               "JAX's names (jax.default_matmul_precision)")


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
        rft: rejection-sampling fine-tuning, GRPO's control: SFT on the student's own rewarded rollouts.
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
        for key in ("opd.sampler", "grpo.sampler", "rft.sampler", "eval.sampler"):  # the canvas's lengths are known now
            section, name = key.split(".")
            try:
                getattr(getattr(self, section), name).sampler_config(self.canvas, mask_id=0, pad_id=0)
            except ConfigError as err:
                raise ConfigError(f"{key}.{err}") from None
        self._check_batches_split_over_the_mesh()
        for change in self.run.allow_changes:  # a misspelt training field would otherwise allow nothing, silently
            parts = change.split(".")
            if parts[:2] == ["identity", "architecture"] and len(parts) > 2:
                known = {f.name for f in dataclasses.fields(ModelConfig)}
                if parts[2] not in known:
                    raise ConfigError(f"run.allow_changes: {change!r}: a model's architecture has no key {parts[2]!r} "
                                      f"(it has {', '.join(sorted(known))}); name a field as a refused resume names it")
                continue
            if parts[0] != "training" or len(parts) < 3 or parts[1] not in ("task", "sft", "opd", "grpo", "rft"):
                continue
            value: Any = to_dict(getattr(self, parts[1]))
            for i, part in enumerate(parts[2:], 2):
                if not isinstance(value, dict) or part not in value:
                    raise ConfigError(f"run.allow_changes: {change!r}: [{'.'.join(parts[1:i])}] has no key {part!r}; "
                                      f"name a field as a refused resume names it")
                value = value[part]
        if self.task.chat_template is not False:
            try:
                self.chat_template()
            except ChatTemplateError as err:
                raise ConfigError(f"task.chat_template: {err}") from None
        if self.canvas.policy != "block_aligned":
            raise ConfigError("canvas.policy: the pipeline's rollouts (OPD, GRPO, eval) decode on the block-aligned "
                              "canvas; use policy = 'block_aligned' (the contiguous canvas is for bd_data's SFT "
                              "pipelines on their own)")

    def _check_batches_split_over_the_mesh(self) -> None:
        """Each microbatch's rows are split over the mesh's `data` x `fsdp` devices: refused here, by
        key, rather than when the stage starts after the ones before it have trained."""
        shards, mesh = self.mesh.data * self.mesh.fsdp, self.mesh
        for role in ("teacher", "student"):  # sizes a preset sets (a checkpoint's are checked when read)
            section = getattr(self, role)
            if section.pretrained is None and section.checkpoint is None:
                kwargs = section.model_kwargs()
                for key, axes, n in (("n_heads", "model", mesh.model), ("n_kv_heads", "model", mesh.model),
                                     ("d_ff", "model", mesh.model), ("d_model", "fsdp", mesh.fsdp)):
                    if kwargs[key] % n:
                        raise ConfigError(f"{role}.{key}: {kwargs[key]} does not divide the mesh's {axes} = {n} "
                                          f"devices it is split over; make it a multiple of {n}, or change [mesh]")
        if shards == 1:
            return
        sft, opd, grpo = self.sft, self.opd, self.grpo
        for key, rows, microbatches, what in (
                ("sft.batch_size", sft.batch_size, sft.microbatches, "batch_size"),
                ("opd.prompts_per_step", opd.prompts_per_step, opd.microbatches, "prompts_per_step"),
                ("grpo.prompts_per_step", grpo.prompts_per_step * grpo.group_size, grpo.microbatches,
                 "prompts_per_step x group_size")):
            check_rows_split(key, rows, microbatches, what, shards)

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
    config = build(PipelineConfig, data)
    canvas = value if isinstance(value := data.get("canvas"), dict) else {}
    trained = None if "block_size" in canvas else pretrained_block_size(config)
    if trained is not None and trained[1] != config.canvas.block_size:  # the checkpoint's block, unless set
        try:
            config = build(PipelineConfig, {**data, "canvas": {**canvas, "block_size": trained[1]}})
        except ConfigError as err:
            raise ConfigError(f"{err} (canvas.block_size = {trained[1]} is the {trained[0]}'s pretrained "
                              f"checkpoint's; set [canvas] block_size to choose another)") from None
    return config.to_dict()


def check_rows_split(key: str, rows: int, microbatches: int, what: str, shards: int) -> None:
    """A stage's rows per microbatch split over the mesh's `shards` data-parallel devices, or a
    `ConfigError` naming the preset key."""
    if (rows // microbatches) % shards:
        raise ConfigError(f"{key}: {what} = {rows} in {microbatches} microbatch(es) gives {rows // microbatches} "
                          f"rows per microbatch, which the mesh's data x fsdp = {shards} devices must divide; "
                          f"make {what} / microbatches a multiple of {shards}, or change [mesh]")


def unused_task_keys(config: PipelineConfig) -> list[str]:
    """Lines naming the `[task]` keys that the config's data does not use: a built-in task's `name`
    or `params` beside the user's JSONL files (which are rewarded by exact match), `overlong` with
    a built-in task (whose problems must each fit the canvas). Said, not refused: a checkpoint's
    recorded config may hold them."""
    task, default = config.task, TaskSection()
    if task.train_jsonl is not None:
        keys = [key for key in ("name", "params") if getattr(task, key) != getattr(default, key)]
        return [f"task.{key}: unused beside train_jsonl / eval_jsonl, whose answers are rewarded by exact match "
                f"(for math-verify rewards on your file, use name = \"math\" with params.path instead of the JSONL "
                f"keys)" for key in keys]
    if task.overlong != default.overlong:
        return [f"task.overlong = {task.overlong!r}: unused with a built-in task, whose problems must each fit the "
                f"canvas (checked at the start; raise [canvas] prompt_len / max_new_tokens)"]
    return []


def pretrained_block_size(config: PipelineConfig) -> tuple[str, int] | None:
    """(role, block size) of the student's pretrained checkpoint, else the teacher's, where its
    config.json names one (`block_size`, SDAR's; `bd_size`, Fast-dLLM v2's); None for none (an
    autoregressive checkpoint, or no pretrained one), where the canvas's block size is the choice."""
    from bd_models import hf_block_size, read_hf_config

    for role in ("student", "teacher"):
        folder = getattr(config, role).folder
        block = hf_block_size(read_hf_config(folder)) if folder else None
        if block is not None:
            return role, block
    return None


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


Params = ParamSpec("Params")
Result = TypeVar("Result")


def under_run_precision(stage: Callable[Params, Result]) -> Callable[Params, Result]:
    """`stage` (a function of the run config `config`, first or by name, like `run_sft`) with
    float32 matrix products at `[run] matmul_precision`: its rollouts, replays, train steps and
    evaluation alike. A stage of your own gets it by this decorator too.

    Example:
        ```py
        from bd_train.stages import under_run_precision

        @under_run_precision
        def run_my_stage(config, where, *, start):
            ...
        ```
    """
    @functools.wraps(stage)
    def run(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        config = kwargs["config"] if "config" in kwargs else args[0]
        with matmul_precision(pipeline_config(config).run.matmul_precision):
            return stage(*args, **kwargs)

    return run
