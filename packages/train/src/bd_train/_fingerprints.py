"""Model-identity and rollout-semantics fingerprints built from plain values or config objects.

Configs may be dataclasses, objects with `to_dict()`, or mappings, so checkpoints can be checked
before (or without) importing the packages that define them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bd_core import TRACE_VERSION, Fingerprint, fingerprint

# What a sampler config must pin for replayed log-probs (and so importance ratios) to mean the
# same thing: the distribution, the commit rule, stopping and the lengths.
ROLLOUT_FIELDS = ("temperature", "top_k", "top_p", "strategy", "confidence", "threshold", "steps_per_block",
                  "max_steps_per_block", "stop_ids", "block_size", "max_new_tokens")


def as_plain_dict(config: Any, what: str) -> dict[str, Any]:
    """A config as a dict: mappings as-is, `to_dict()` if defined, dataclass fields otherwise."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise TypeError(f"{what}: expected a mapping, a dataclass or an object with to_dict(), got "
                    f"{type(config).__name__}")


def model_identity(architecture: Any, *, tokenizer: Any, vocab_size: int, mask_id: int, block_size: int,
                   canvas_policy: str = "block_aligned", alignment: str = "target",
                   extra: Mapping[str, Any] | None = None) -> Fingerprint:
    """What makes two checkpoints the same model: its architecture (e.g. `ModelConfig`), the
    tokenizer's identity (a name or a dict of its defining values), vocabulary and special ids,
    block size, canvas policy and target alignment, plus any `extra` fields a caller pins."""
    return fingerprint({
        **(extra or {}),
        "architecture": as_plain_dict(architecture, "model_identity(architecture=...)"),
        "tokenizer": tokenizer if isinstance(tokenizer, (str, int, type(None))) else as_plain_dict(
            tokenizer, "model_identity(tokenizer=...)"),
        "vocab_size": vocab_size,
        "mask_id": mask_id,
        "block_size": block_size,
        "canvas_policy": canvas_policy,
        "alignment": alignment,
    })


def rollout_semantics(sampler: Any, *, prompt_len: int, trace_version: int = TRACE_VERSION) -> Fingerprint:
    """The sampling semantics a GRPO run's traces were recorded under (from a `SamplerConfig` or a
    mapping with the same field names), plus the prompt length and the trace format version; ids
    the distribution bans besides the mask and pad ids (`banned_ids`) are pinned where there are any."""
    values = as_plain_dict(sampler, "rollout_semantics(sampler=...)")
    missing = [name for name in ROLLOUT_FIELDS if name not in values]
    if missing:
        raise ValueError(f"rollout_semantics: the sampler config lacks field(s) {missing}; pass a SamplerConfig or "
                         f"a mapping with all of {list(ROLLOUT_FIELDS)}")
    fields = {name: values[name] for name in ROLLOUT_FIELDS}
    fields.update(prompt_len=prompt_len, trace_version=trace_version)
    # Ids banned beyond the mask and pad ids (which every sampler bans) change the distribution the
    # log-probs were recorded under; pinned only when present, so every other fingerprint is unchanged.
    banned = values.get("banned_ids", getattr(sampler, "banned_ids", ()))
    extra = sorted({int(token) for token in banned} - {values.get("mask_id"), values.get("pad_id")})
    if extra:
        fields["banned_ids"] = extra
    return fingerprint(fields)
