"""Checks that a run's checkpoints fit together, before anything trains and between stages:
adopted checkpoints and a distillation pair must share the config's tokens and blocks (not the
architecture), each mismatch refused with every differing field named."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bd_core import ConfigError, Fingerprint, FingerprintMismatch, fingerprint, require_compatible
from bd_data import CanvasOverflow, ChatTemplateError, JsonlError, JsonlSource, TokenizerError
from bd_models import ModelConfig

from .._checkpoint import CheckpointError
from ._config import pretrained_block_size, unused_task_keys
from ._errors import CanvasTooSmall
from ._run import EXECUTION_FIELDS, ROLES, Run, StageError, open_checkpoints

if TYPE_CHECKING:
    from ._driver import StageResult

# Fields that must agree between a teacher and the student it distills into: everything about
# tokens and blocks, nothing about the architecture.
SHARED_IDENTITY_KEYS = ("tokenizer", "vocab_size", "mask_id", "pad_id", "eos_id", "block_size", "canvas_policy",
                        "prompt_len", "max_new_tokens", "alignment")

def saved_model_config(run: Run, identity: Fingerprint, role: str) -> ModelConfig:
    """The architecture a checkpoint's `identity` records, computed as `[role]` says (attention,
    tiles, remat, logits chunks: what an identity leaves out): an adopted SFT's, or OPD's teacher."""
    kwargs = getattr(run.config, role).model_kwargs()
    return ModelConfig.from_dict({**identity.fields["architecture"],
                                  **{k: kwargs[k] for k in EXECUTION_FIELDS if k in kwargs}})


def _latest_meta(directory: str | Path) -> dict[str, Any]:
    """The metadata of a stage checkpoint folder's latest step."""
    checkpoints = open_checkpoints(directory, create=False)
    try:
        return checkpoints.read_meta()
    except CheckpointError as err:
        raise StageError(str(err)) from None
    finally:
        checkpoints.close()


def saved_identity(directory: str | Path, meta: dict[str, Any] | None = None) -> Fingerprint:
    """The identity fingerprint a stage checkpoint was saved with (`meta`: its latest step's
    metadata, if read already)."""
    record = ((_latest_meta(directory) if meta is None else meta).get("fingerprints") or {}).get("identity")
    if record is None:
        raise StageError(f"checkpoint {directory} records no model identity; it was not written by a bdlm stage")
    return Fingerprint.from_json(record)


def saved_stage(directory: str | Path, meta: dict[str, Any] | None = None) -> tuple[str, int]:
    """Which stage wrote a stage checkpoint, and its latest step (`meta` as in `saved_identity`).
    A checkpoint from before the stage was recorded is named by its training section (`"sft"`, ...)."""
    meta = _latest_meta(directory) if meta is None else meta
    stage = (meta.get("extra") or {}).get("stage")
    if stage is None:  # the training fingerprint's one stage section
        fields = ((meta.get("fingerprints") or {}).get("training") or {}).get("fields") or {}
        sections = sorted(set(fields) - {"seed", "task", "steps", "chat_template", "data"})
        stage = sections[0] if len(sections) == 1 else "an unknown stage"
    return str(stage), int(meta["step"])


def saved_weights(directory: str | Path) -> Fingerprint:
    """What the model of a stage checkpoint's latest step holds: its step and a digest of the
    content digests the save recorded for every model array (a checkpoint from before digests
    were recorded gives its step alone). A stage that reads another's model at every update pins
    it (OPD its teacher, GRPO the model it starts from, its KL reference), so a resume against
    other weights is refused. By content, not by the folder's path."""
    meta = _latest_meta(directory)
    model = {path: shards for path, shards in sorted((meta.get("digests") or {}).items()) if path.startswith("model/")}
    content = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest() if model else None
    return fingerprint({"step": int(meta["step"]), "model": content})


def teacher_pins(teacher: StageResult) -> dict[str, Fingerprint]:
    """What OPD's checkpoints pin of its teacher: what it is (`teacher`: its identity) and what
    its weights are (`teacher_weights`), which OPD reads at every update."""
    return {"teacher": teacher.fingerprint, "teacher_weights": saved_weights(teacher.checkpoint_dir)}


def adoption(role: str, directory: str | Path, meta: dict[str, Any] | None = None) -> str:
    """One line saying what `[role] checkpoint` adopts: the folder, its step and the stage that
    wrote it, with a warning when that is not the role's own SFT (another stage's model, or the
    other role's, is adopted as it is: allowed, but rarely meant)."""
    stage, step = saved_stage(directory, meta)
    line = f"{role}.checkpoint: adopting {directory} (step {step}, written by stage {stage})"
    if stage not in (f"sft-{role}", "sft"):
        line += (f"; that is not the {role}'s SFT (sft-{role}), so the {role} is that stage's model as it is. "
                 f"If you meant the {role}'s SFT, give runs/pipeline/<run-id>/checkpoints/sft-{role}")
    return line


TASK_PROBLEMS_CHECKED = 512  # a built-in task's training problems fitted to the canvas before training


def check_task_fits(run: Run, split: str, count: int | None) -> None:
    """The split's first `count` problems (None: all) of the built-in task fit the canvas: the prompt, as the
    chat template renders it if there is one, and for the training split (which SFT trains on) the
    answer plus the end-of-text token; or a `StageError` naming the first that does not, its sizes
    and the `[canvas]` key to raise (`CanvasTooSmall`). Held-out problems are only ever prompts on the canvas."""
    canvas = run.config.canvas
    source = run.source(split)
    markup = " with the chat template's markup" if run.chat_template is not None else ""
    where = getattr(run.task, "where", None)  # a task read from a file (math) names the line
    smaller = "shorten or remove that problem" if where is not None else "choose smaller [task] params"
    for index in range(len(source) if count is None else min(count, len(source))):
        example = source[index]
        prompt, answer = example.token_ids(run.tokenizer)
        problem = f"{split} problem {index} of task {run.config.task.name!r}"
        problem += f" ({where(index, split)})" if where is not None else ""
        if len(prompt) > canvas.prompt_len:
            raise CanvasTooSmall("canvas.prompt_len",
                                 f"{problem} ({example.prompt[:200]!r}) takes {len(prompt)} tokens{markup} but "
                                 f"canvas.prompt_len = {canvas.prompt_len}",
                                 f"raise prompt_len (a multiple of block_size = {canvas.block_size}) or {smaller}")
        if split == "train" and len(answer) + 1 > canvas.max_new_tokens:
            raise CanvasTooSmall("canvas.max_new_tokens",
                                 f"training{problem.removeprefix(split)} has an answer of {len(answer)} tokens, "
                                 f"{len(answer) + 1} with the end-of-text token, but canvas.max_new_tokens = "
                                 f"{canvas.max_new_tokens}",
                                 f"raise max_new_tokens (a multiple of block_size = {canvas.block_size}) or {smaller}")


def check_adopted(config: Any) -> None:
    """Before anything trains: every checkpoint the config adopts (`[teacher]/[student] checkpoint`)
    must share the config's tokens and blocks, or the run is refused now, naming each field. The
    tokenizer, the pretrained checkpoints' configs and the user's JSONL files (every line) are read
    now too, a built-in task's first training problems and held-out ones are fitted to the canvas
    (`check_task_fits`, through the chat template if any), and a teacher and
    student whose output vocabularies differ are refused. Each adopted checkpoint is said on
    stderr, with the stage that wrote it (`adoption`), and a `[canvas] block_size` other than the
    pretrained checkpoint's (which it defaults to) too."""
    run = Run(config)
    try:
        _ = run.tokenizer  # loads and checks the special tokens
        _ = run.task  # builds the built-in task with its params
        sizes = {role: run.model_config(role).vocab_size for role in ROLES if not getattr(run.config, role).checkpoint}
        for role in sizes:  # every shard there and readable, now rather than when the role's SFT starts
            if getattr(run.config, role).folder:
                run.check_pretrained(role)
        if run.task is None:  # the user's JSONL: every line, tokenized and fitted to the canvas, now
            for split in ("train", "eval"):
                source = run.source(split)
                assert isinstance(source, JsonlSource)  # no built-in task: the user's files
                report = source.report
                if report.truncated or report.skipped:  # said: what trains is not the whole file
                    lines = report.truncated_lines or report.skipped_lines
                    shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
                    print(f"task.{split}_jsonl: {source.path}: {report.summary()} of {len(source) + report.skipped} "
                          f"(lines {shown})", file=sys.stderr)
        else:  # a built-in task: its first training problems and every held-out one, fitted to the canvas now
            every = bool(getattr(run.task, "file_params", ()))  # a file's problems: all of them, now
            for split, count in (("train", TASK_PROBLEMS_CHECKED), ("eval", run.config.eval.n)):
                check_task_fits(run, split, None if every else count)
    except (TokenizerError, ConfigError, JsonlError, CanvasOverflow) as err:
        raise StageError(str(err)) from None
    except ChatTemplateError as err:
        raise StageError(f"task.chat_template: {err}") from None
    for line in unused_task_keys(run.config):
        print(line, file=sys.stderr)
    trained = pretrained_block_size(run.config)
    if trained is not None and trained[1] != run.config.canvas.block_size:  # set on purpose: said, not refused
        print(f"canvas.block_size = {run.config.canvas.block_size}: the {trained[0]}'s pretrained checkpoint was "
              f"trained with block size {trained[1]}; its model runs, and exports, at {run.config.canvas.block_size}",
              file=sys.stderr)
    if len(set(sizes.values())) > 1:
        raise StageError(f"teacher vocab_size {sizes['teacher']} != student vocab_size {sizes['student']} (from "
                         f"their config.json files): distillation compares the two output distributions token by "
                         f"token; use checkpoints of one family (same vocab_size)")
    for role in ROLES:
        directory = getattr(run.config, role).checkpoint
        if directory:
            try:
                meta = _latest_meta(directory)  # read once for what it is and who wrote it
                print(adoption(role, directory, meta), file=sys.stderr)
                identity = saved_identity(directory, meta)
            except StageError as err:
                raise StageError(f"{role}.checkpoint: {err}") from None
            try:
                require_compatible(identity, run.identity("student"), SHARED_IDENTITY_KEYS,
                                   context=f"{role} checkpoint {directory} vs this config")
            except FingerprintMismatch as err:
                raise StageError(f"{err}\nThe {role} must use the config's tokenizer, block size and canvas.") from None


def check_distillation_pair(teacher: StageResult, student: StageResult) -> None:
    """Teacher and student must share tokens and blocks (not the architecture) to distill."""
    try:
        require_compatible(teacher.fingerprint, student.fingerprint, SHARED_IDENTITY_KEYS,
                           context=f"teacher checkpoint {teacher.checkpoint_dir} vs student")
    except FingerprintMismatch as err:
        raise StageError(f"{err}\nThe teacher must use the student's tokenizer, block size and canvas.") from None
