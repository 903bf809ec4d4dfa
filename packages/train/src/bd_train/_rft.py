"""Rejection-sampling fine-tuning's batch: sampled completions laid out as SFT's clean canvases,
corrupted as SFT corrupts them, with every rejected row's weights set to zero.

One shape serves every round (the rows sampled, accepted or not), so the train step compiles
once; `sft_objective` on the batch is the SFT loss of the accepted rows alone, since a row of
weight 0 adds exactly 0 to the numerator and the denominator, and the trainer normalises once
over all kept tokens of every microbatch and device. Nothing here reads a reference answer.
Shape letters: see bd_core (B rows, P prompt, N new tokens, C = P + N canvas, b block size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bd_core import DiffusionTokenBatch, RolloutOutput
from bd_data import Canvas, CanvasConfig, CorruptionConfig, corrupt


def sampled_canvas(rollout: RolloutOutput, *, block_size: int, eos_id: int, pad_id: int) -> Canvas:
    """The clean block-aligned canvases `[B, C]` of a rollout's completions (host arrays), laid out
    as SFT lays out `answer + eos`: the completion cut after its first `eos_id` (the rest of that
    block eos, later blocks invalid), i.e. the text `decode_completions` scored; a row that
    generated no eos keeps every token it generated. Positions are the slot indices, as sampled."""
    prompt_BxP, prompt_valid_BxP = np.asarray(rollout.prompt_tokens), np.asarray(rollout.prompt_valid, bool)
    tokens_BxN, generated_BxN = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_valid, bool)
    rows, new = tokens_BxN.shape
    slot_N = np.arange(new)
    is_eos_BxN = (tokens_BxN == eos_id) & generated_BxN
    stops_B = is_eos_BxN.any(axis=1)
    first_B = np.where(stops_B, is_eos_BxN.argmax(axis=1), new)
    end_B = np.where(stops_B, (first_B // block_size + 1) * block_size, new)  # the stop block's end
    valid_BxN = generated_BxN & (slot_N < end_B[:, None])
    completion_BxN = np.where(slot_N < first_B[:, None], tokens_BxN, eos_id)
    length = prompt_BxP.shape[1] + new
    slots = np.arange(length, dtype=np.int32)
    return Canvas(
        tokens=np.concatenate([prompt_BxP, np.where(valid_BxN, completion_BxN, pad_id)], axis=1).astype(np.int32),
        valid=np.concatenate([prompt_valid_BxP, valid_BxN], axis=1),
        positions=np.broadcast_to(slots, (rows, length)).copy(),
        block_ids=np.broadcast_to(slots // block_size, (rows, length)).copy(),
    )


def rft_batch(rollout: RolloutOutput, accepted: np.ndarray, *, canvas: CanvasConfig, corruption: CorruptionConfig,
              tokenizer: Any, rng: np.random.Generator) -> DiffusionTokenBatch:
    """The SFT batch of a rollout's completions (host arrays, `[B, ...]`): each row corrupted by
    `bd_data.corrupt` with `rng`, and the rows where `accepted` `[B]` is False weighted 0 (loss
    weights and denominator weights both)."""
    clean = sampled_canvas(rollout, block_size=canvas.block_size, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    batch = corrupt(clean, canvas, corruption, mask_id=tokenizer.mask_id, rng=rng)
    keep_Bx1 = np.asarray(accepted, bool)[:, None].astype(np.float32)
    return dataclasses.replace(batch, weights=batch.weights * keep_Bx1, denom_weights=batch.denom_weights * keep_Bx1)
