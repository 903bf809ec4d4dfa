"""The single changes a plan tries on a stage that does not fit, and the microbatch counts that
split a stage's rows over a mesh's data-parallel chips (`bd_train.plan`)."""

from __future__ import annotations

import json
from typing import Any


def microbatch_counts(config: dict, stage: str, mesh: dict[str, int]) -> tuple[str, int, list[int]]:
    """The stage's section, its configured microbatch count, and every count that splits its rows
    into microbatches whose rows the data-parallel chips divide."""
    name = "sft" if stage.startswith("sft-") else stage
    section = config.get(name, {})
    defaults = {"sft": (128, 1), "opd": (64, 1), "grpo": (16, 8)}[name]
    rows = section.get("batch_size" if name == "sft" else "prompts_per_step", defaults[0])
    rows *= section.get("group_size", defaults[1]) if name == "grpo" else 1
    shards = mesh["data"] * mesh["fsdp"]
    return name, section.get("microbatches", 1), [m for m in range(1, rows + 1)
                                                  if rows % m == 0 and (rows // m) % shards == 0]


def with_attention(data: dict, attention: str | None) -> dict:
    """The preset with both models' attention replaced by `attention` (`--attention`), if given."""
    if attention is None:
        return data
    return {**data, **{role: {**data.get(role, {}), "attention": attention} for role in ("teacher", "student")}}


def planned_on(config: dict, mesh: dict[str, int]) -> dict:
    """The preset with the mesh a plan lays over the slice as its `[mesh]` (one node: the plan
    places the hosts itself), so that its rows per data-parallel chip, and every remedy's, are
    checked against the mesh planned rather than the one the preset was written for."""
    return {**config, "mesh": {**config.get("mesh", {}), **mesh, "num_nodes": 1}}


def remedies_for(config: dict, stage: str, mesh: dict[str, int], over: float) -> list[tuple[str, dict, dict[str, int]]]:
    """Single changes that cut a stage's memory, as (description, changed config data, mesh), for
    a stage `over` times too large: more microbatches (the smallest count that might fit, then
    twice it), remat `full`, half the held-out decoding's rows (its temporaries, where the stage
    holds a teacher and a LoRA model's train state beside them, can be the stage's peak), `fsdp`
    over the data axis, LoRA."""
    from .stages._stage_sections import EvalSection

    role = stage.removeprefix("sft-") if stage.startswith("sft-") else "student"
    out = []

    def changed(section: str, **values: Any) -> dict:
        data = json.loads(json.dumps(config))
        data.setdefault(section, {}).update(values)
        return data

    name, k, counts = microbatch_counts(config, stage, mesh)
    valid = [m for m in counts if m > k]
    first = next((m for m in valid if m >= k * over), valid[-1] if valid else None)
    for more in [m for m in valid if m >= (first or 0)][:2]:
        out.append((f"[{name}] microbatches = {more}", changed(name, microbatches=more), mesh))
    if config.get(role, {}).get("remat", "elementwise") != "full":
        out.append((f'[{role}] remat = "full"', changed(role, remat="full"), mesh))
    evaluation = config.get("eval", {})
    rows = min(evaluation.get("batch_size", EvalSection.batch_size), evaluation.get("n", EvalSection.n))
    if rows // 2 >= mesh["data"] * mesh["fsdp"]:
        out.append((f"[eval] batch_size = {rows // 2}", changed("eval", batch_size=rows // 2), mesh))
    if mesh["data"] > 1:
        folded = {"data": 1, "fsdp": mesh["data"] * mesh["fsdp"], "model": mesh["model"]}
        out.append((f"[mesh] fsdp = {folded['fsdp']}, data = 1", config, folded))
    lora = config.get(role, {}).get("lora")
    if lora is None and (name != "sft" or config.get(role, {}).get("pretrained")):
        adapters = {"rank": 16, "alpha": 32.0, "targets": ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"],
                    "stages": [name]}
        out.append((f"[{role}] lora = {{rank = 16, all seven projections, stages = [\"{name}\"]}}",
                    changed(role, lora=adapters), mesh))
    return out


def layout_remedy(config: dict, stage: str, mesh: dict[str, int]) -> tuple[str, dict] | None:
    """For a stage whose rows per microbatch do not divide the data-parallel axes: the largest
    microbatch count below the configured one that splits them, as (description, changed data)."""
    name, k, counts = microbatch_counts(config, stage, mesh)
    valid = [m for m in counts if m < k]
    if not valid:
        return None
    changed = json.loads(json.dumps(config))
    changed.setdefault(name, {})["microbatches"] = valid[-1]
    return f"[{name}] microbatches = {valid[-1]}", changed
