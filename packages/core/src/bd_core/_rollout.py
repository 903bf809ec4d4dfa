"""Exact denoising traces and rollout outputs, and the atomic merge of rollout shards.

A `DiffusionTrace` records, per row and denoising step, the canvas block, which positions of the
block were committed, the committed tokens and their log-probs under the distribution actually
sampled, and whether the step happened. Replaying it through the packed layout reproduces the
log-probs exactly; that is what makes importance ratios and on-policy distillation correct.
Shape letters: see bd_core (B batch, R trace steps, b block size, P prompt, N new tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._validate import ContractError, check_bool, check_float, check_int, check_rank, check_shape, is_concrete

Array = jax.Array

TRACE_VERSION = 1
"""The version of `DiffusionTrace`'s layout; a replay refuses a trace of another version."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiffusionTrace:
    """Per row and step (`R` steps, block size `b`): block `[B, R]`, committed mask, tokens and
    log-probs `[B, R, b]`, step validity `[B, R]`. Uncommitted entries hold token 0, log-prob 0.

    Attributes:
        block_ids: `[B, R]` the block each step denoised.
        committed: `[B, R, b]` which of the block's positions committed at that step.
        tokens: `[B, R, b]` the committed tokens.
        logprobs: `[B, R, b]` their log-probabilities under the sampling distribution.
        step_valid: `[B, R]` whether the row took that step.
        version: the trace layout's version (`TRACE_VERSION`).
    """

    block_ids: Array
    committed: Array
    tokens: Array
    logprobs: Array
    step_valid: Array
    version: int = dataclasses.field(default=TRACE_VERSION, metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return int(np.shape(self.block_ids)[0])

    @property
    def num_steps(self) -> int:
        return int(np.shape(self.block_ids)[1])

    @property
    def block_size(self) -> int:
        return int(np.shape(self.committed)[2])

    def validate(self) -> DiffusionTrace:
        """Check the trace's shapes, dtypes and version; returns self or raises `ContractError` naming the field."""
        owner = "DiffusionTrace"
        b, r = check_rank(owner, "block_ids", self.block_ids, 2, "B, R")
        check_int(owner, "block_ids", self.block_ids)
        shape3 = check_rank(owner, "committed", self.committed, 3, "B, R, b")
        if shape3[:2] != (b, r):
            raise ContractError(f"{owner}.committed: expected shape ({b}, {r}, b) [B, R, b], got {shape3}")
        check_bool(owner, "committed", self.committed)
        check_shape(owner, "tokens", self.tokens, shape3, "B, R, b")
        check_int(owner, "tokens", self.tokens)
        check_shape(owner, "logprobs", self.logprobs, shape3, "B, R, b")
        check_float(owner, "logprobs", self.logprobs)
        check_shape(owner, "step_valid", self.step_valid, (b, r), "B, R")
        check_bool(owner, "step_valid", self.step_valid)
        if self.version != TRACE_VERSION:
            raise ContractError(f"{owner}.version: this code replays trace version {TRACE_VERSION}, got {self.version}")
        if is_concrete(self):
            committed, valid = np.asarray(self.committed), np.asarray(self.step_valid)
            if np.any(committed & ~valid[:, :, None]):
                raise ContractError(
                    f"{owner}.committed: a position is committed in a step that step_valid marks invalid")
            lp = np.asarray(self.logprobs)[committed]
            if lp.size and (not np.all(np.isfinite(lp)) or lp.max() > 1e-6):
                raise ContractError(f"{owner}.logprobs: committed log-probs must be finite and <= 0")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutOutput:
    """Generated completions for a left-padded prompt batch.

    `prompt_tokens/prompt_valid` `[B, P]`; `completion_tokens/completion_valid` `[B, N]` (valid =
    inside a block that was generated); `nfe` `[B]` forward passes in which the row was active;
    `trace` the exact denoising trace (or None).

    Attributes:
        prompt_tokens: `[B, P]` the left-padded prompts.
        prompt_valid: `[B, P]` False for padding.
        completion_tokens: `[B, N]` the generated tokens.
        completion_valid: `[B, N]` True inside blocks that were generated.
        nfe: `[B]` forward passes in which the row was active.
        trace: the exact denoising trace, or None.
    """

    prompt_tokens: Array
    prompt_valid: Array
    completion_tokens: Array
    completion_valid: Array
    nfe: Array
    trace: DiffusionTrace | None = None

    @property
    def batch_size(self) -> int:
        return int(np.shape(self.prompt_tokens)[0])

    def validate(self) -> RolloutOutput:
        """Check the rollout's shapes and dtypes (and its trace's); returns self or raises `ContractError` naming the
        field."""
        owner = "RolloutOutput"
        b, _ = check_rank(owner, "prompt_tokens", self.prompt_tokens, 2, "B, P")
        check_int(owner, "prompt_tokens", self.prompt_tokens)
        check_shape(owner, "prompt_valid", self.prompt_valid, np.shape(self.prompt_tokens), "B, P")
        check_bool(owner, "prompt_valid", self.prompt_valid)
        shape = check_rank(owner, "completion_tokens", self.completion_tokens, 2, "B, N")
        if shape[0] != b:
            raise ContractError(f"{owner}.completion_tokens: expected {b} rows like prompt_tokens, got {shape[0]}")
        check_int(owner, "completion_tokens", self.completion_tokens)
        check_shape(owner, "completion_valid", self.completion_valid, shape, "B, N")
        check_bool(owner, "completion_valid", self.completion_valid)
        check_shape(owner, "nfe", self.nfe, (b,), "B")
        if self.trace is not None:
            self.trace.validate()
            if self.trace.batch_size != b:
                raise ContractError(f"{owner}.trace: expected {b} rows, got {self.trace.batch_size}")
        return self


def _leaf_paths(tree) -> list[tuple[str, Array]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def merge_rollouts(outputs: Sequence[RolloutOutput]) -> RolloutOutput:
    """Concatenate rollout shards on the batch axis, atomically.

    Every shard must carry a trace or none does, their tree structures and per-row shapes must
    match, and each field's rows must equal the shard's batch
    size. Otherwise a `ContractError` names the shard and the field; nothing is half-merged.
    """
    outputs = list(outputs)
    if not outputs:
        raise ContractError("merge_rollouts: got no shards")
    for index, out in enumerate(outputs):
        if not isinstance(out, RolloutOutput):
            raise ContractError(f"merge_rollouts: shard {index} is a {type(out).__name__}, expected a RolloutOutput")
    present = [out.trace is not None for out in outputs]
    if any(present) and not all(present):
        missing = [i for i, p in enumerate(present) if not p]
        raise ContractError(
            f"merge_rollouts: field 'trace' is present in some shards but missing in shard(s) {missing}; "
            f"every shard must carry a trace or none may"
        )
    reference = _leaf_paths(outputs[0])
    ref_struct = jax.tree_util.tree_structure(outputs[0])
    for index, out in enumerate(outputs):
        if jax.tree_util.tree_structure(out) != ref_struct:
            raise ContractError(
                f"merge_rollouts: shard {index} has tree structure {jax.tree_util.tree_structure(out)}, "
                f"shard 0 has {ref_struct}"
            )
        rows = out.batch_size
        for (name, leaf), (_, ref_leaf) in zip(_leaf_paths(out), reference):
            shape, ref_shape = np.shape(leaf), np.shape(ref_leaf)
            if len(shape) == 0 or shape[0] != rows:
                raise ContractError(
                    f"merge_rollouts: shard {index} field {name} has shape {shape}; expected {rows} rows (the "
                    f"shard's batch size) on axis 0"
                )
            if shape[1:] != ref_shape[1:] or jnp.dtype(leaf.dtype) != jnp.dtype(ref_leaf.dtype):
                raise ContractError(
                    f"merge_rollouts: shard {index} field {name} has per-row shape {shape[1:]} {leaf.dtype}, "
                    f"shard 0 has {ref_shape[1:]} {ref_leaf.dtype}"
                )
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *outputs)
