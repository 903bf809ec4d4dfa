"""`RunData`: what a pipeline run reads and draws, as every stage sees it: the tokenizer, the task
or the user's JSONL (through the chat template, if any) and the digests of its files, each
stage's batches and prompts, the rewards, and the named random streams of each stage. `Run`
builds the models on top of it.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jax

from bd_core import ConfigError
from bd_data import (
    ByteTokenizer,
    ChatSource,
    ChatTemplate,
    Example,
    HFTokenizer,
    TokenizerError,
    get_task,
    iterate,
    load_jsonl,
    prompt_dataset,
    sft_dataset,
    special_tokens,
    tokenizer_config,
)

from ._errors import StageError

if TYPE_CHECKING:
    from ._config import PipelineConfig

# Each stage's random stream: its key is `fold_in(key(seed), index)` and its data seed
# `seed + index`. (The indices are the values earlier versions hard-coded, so runs reproduce.)
STREAMS = {"sft-teacher": 0, "sft-student": 1, "opd": 2, "grpo": 3, "rft": 4}


def stream(stage: str) -> int:
    """A stage's random stream: fixed for the pipeline's stages; a recipe of your own (any other
    name) gets one from a hash of its name, the same in every run and process."""
    return STREAMS[stage] if stage in STREAMS else 1000 + zlib.crc32(stage.encode()) % 1_000_000


class RunData:
    """A run's data and random streams, from its validated `PipelineConfig`; `tokenizer` stands in
    for the configured one (see `Run`)."""

    def __init__(self, config: PipelineConfig, *, tokenizer: Any = None):
        self.config = config
        if tokenizer is not None:
            self.tokenizer = tokenizer  # fills the cached property

    # -- random streams ------------------------------------------------------------------------------

    def keys(self, stage: str, *names: str) -> dict[str, jax.Array]:
        """The stage's key split into one key per name (in the order given)."""
        key = jax.random.fold_in(jax.random.key(self.config.run.seed), stream(stage))
        return dict(zip(names, jax.random.split(key, len(names))))

    def data_seed(self, stage: str) -> int:
        """The seed of `stage`'s data stream: `[run] seed` plus a fixed offset per stage."""
        return self.config.run.seed + stream(stage)

    # -- data and rewards ----------------------------------------------------------------------------

    @functools.cached_property
    def tokenizer(self):
        """The byte tokenizer, the configured tokenizer.json, or the pretrained checkpoint's own
        (the student's, else the teacher's), with its special tokens from its tokenizer_config.json."""
        section = self.config.tokenizer
        path = self.config.tokenizer_file
        if path is None:
            return ByteTokenizer()
        if not Path(path).is_file():
            key = "tokenizer.path" if section.path else "the pretrained checkpoint's tokenizer.json"
            raise StageError(f"{key}: {path!r} does not exist; copy the checkpoint's tokenizer.json there, or set "
                             f"[tokenizer] path to one (with no pretrained model and no path, the byte tokenizer "
                             f"needs no file)")
        try:
            named = special_tokens(tokenizer_config(Path(path).parent))
        except TokenizerError as err:
            raise StageError(f"{err} (the tokens then default to <|mask|> and <|endoftext|>, or set [tokenizer] "
                             f"mask_token / eos_token)") from None
        return HFTokenizer(path, mask_token=section.mask_token or named.get("mask_token", "<|mask|>"),
                           eos_token=section.eos_token or named.get("eos_token", "<|endoftext|>"),
                           add_mask_token=section.add_mask_token)

    @functools.cached_property
    def task(self):
        """The built-in task `[task]` names, built with its `params`; None for the user's JSONL."""
        task = self.config.task
        if task.train_jsonl:
            return None
        try:
            return get_task(task.name, seed=task.seed, **task.params)
        except ConfigError as err:  # `SortTask.lenght: ...` is the preset's `task.params.lenght`
            raise ConfigError(re.sub(r"^\w+Task\.", "task.params.", str(err))) from None

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """`[task] chat_template` (a `bd_data.ChatTemplate`), or None when prompts are fed raw."""
        return self.config.chat_template()

    @functools.cached_property
    def data_digests(self) -> dict[str, str]:
        """The SHA-256 of each data file the run reads, by its preset key: `[task]`'s JSONL files, or
        a built-in task's file params (`Task.file_params`: `math`'s `path` and `eval_path`). The
        stages' checkpoints pin them, so a file edited at the same path is not trained on unnoticed."""
        task = self.config.task
        if self.task is None:
            files = {key: cast(str, getattr(task, key)) for key in ("train_jsonl", "eval_jsonl")}
        else:
            files = {f"params.{k}": getattr(self.task, k) for k in self.task.file_params
                     if getattr(self.task, k) is not None}
        digests = {}
        for key, path in files.items():
            try:
                with open(path, "rb") as file:
                    digests[key] = hashlib.file_digest(file, "sha256").hexdigest()
            except OSError as err:
                raise StageError(f"task.{key}: cannot read {path!r} ({err.strerror})") from None
        return digests

    def source(self, split: str):
        """The split's examples; with a chat template their `prompt_ids` are the rendered prompt's
        (which every stage's batches and the evaluation use), their text stays the raw prompt."""
        task = self.config.task
        if self.task is None:  # the user's JSONL files (the config requires both)
            path = task.train_jsonl if split == "train" else task.eval_jsonl
            return load_jsonl(cast(str, path), tokenizer=self.tokenizer, canvas=self.config.canvas,
                              overlong=task.overlong, chat_template=self.chat_template)
        source = self.task.dataset(split)
        return source if self.chat_template is None else ChatSource(source, self.chat_template, self.tokenizer)

    # A step's batch is built whole on every process (shard 0 of 1): it then depends on the seed
    # alone, not on how many processes run, and placing it on the mesh keeps each process's rows.
    # Tokenizing and masking task examples costs next to nothing beside a step; a corpus-scale
    # pipeline would shard by process and use `shard_batch(..., process_local=True)` instead.
    def sft_batches(self, stage: str):
        """The stage's endless stream of corrupted SFT batches (a grain iterator, checkpointable)."""
        sft = self.config.sft
        return iterate(sft_dataset(self.source("train"), self.tokenizer, self.config.canvas, sft.corruption,
                                   seed=self.data_seed(stage), batch_size=sft.batch_size, shard_index=0,
                                   shard_count=1))

    def prompts(self, stage: str, batch_size: int):
        """The stage's endless stream of training prompts (a grain iterator, checkpointable)."""
        return iterate(prompt_dataset(self.source("train"), self.tokenizer, self.config.canvas,
                                      seed=self.data_seed(stage), batch_size=batch_size, shard_index=0,
                                      shard_count=1))

    def reward(self, example: Example, completion: str) -> float:
        """The task's reward of `completion`; for JSONL data without a task, exact match of the answer."""
        if self.task is not None:
            return self.task.reward(example, completion)
        return 1.0 if completion.strip() == example.answer.strip() else 0.0  # user data: exact match
