"""The preset's `Run` as a plan builds it: from shapes, before any weights (or a tokenizer file)
are fetched."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from bd_models import read_hf_config

from .stages._run import Run


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """What a plan needs of a tokenizer: the vocabulary size and the ids the sampler treats apart."""

    vocab_size: int
    mask_id: int
    pad_id: int
    eos_id: int


def shapes_run(config: Any):
    """The preset's `Run` for shapes: with its configured tokenizer, or, when a pretrained folder
    holds config.json only (a plan before the weights are fetched), the vocabulary and special
    ids of that config."""
    run = Run(config)
    cfg = run.config
    folder = next((getattr(cfg, r).folder for r in ("student", "teacher") if getattr(cfg, r).folder), None)
    tokenizer_file = cfg.tokenizer.path or (str(Path(folder) / "tokenizer.json") if folder else None)
    if folder is None or tokenizer_file is None or Path(tokenizer_file).is_file():
        return run
    raw = read_hf_config(folder)
    vocab = int(raw["vocab_size"]) + int(cfg.tokenizer.add_mask_token)
    eos = raw.get("eos_token_id", 0)
    eos = int(eos[0] if isinstance(eos, list) else eos)
    mask = int(raw.get("mask_token_id", vocab - 1))
    pad = raw.get("pad_token_id")  # ids shape nothing: any id the sampler may not emit will do
    if pad in (None, eos, mask):
        pad = next(i for i in range(vocab - 1, 0, -1) if i not in (eos, mask))
    return Run(config, tokenizer=SpecialIds(vocab, mask, int(pad), eos))
