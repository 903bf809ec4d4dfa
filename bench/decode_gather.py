"""What a held-out decoding holds on each chip under FSDP: the sampler of one model compiled for a
v5e-8 (fsdp 8) at growing depth, its temporaries per chip beside the bfloat16 weights of all its
layers, and the all-gathers of the entry computation (outside every loop) beside those of the
loops' bodies. Temporaries that grow by a whole layer's weights per layer, with the gathers in the
entry computation, mean XLA gathers every layer's weights once and keeps them for the decode loop.

    .plan/bin/python bench/decode_gather.py    # libtpu's compiler, no TPU; bench/results/decode_gather.json

The model is smoke.toml's student widened to 2048 (16 heads, 8 KV heads, d_ff 8192, bfloat16),
decoding 16 rows of a 32-token prompt, 32 new tokens.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_results  # noqa: E402

from bd_train.plan import make_plan_mesh, stage_lowered, topology  # noqa: E402

WIDE = {"d_model": 2048, "n_heads": 16, "n_kv_heads": 8, "d_ff": 8192, "compute_dtype": "bfloat16",
        "param_dtype": "bfloat16"}


def preset(layers: int) -> dict:
    data = tomllib.loads((ROOT / "flows" / "configs" / "smoke.toml").read_text())
    data["student"] |= WIDE | {"n_layers": layers}
    data["canvas"] |= {"prompt_len": 32, "max_new_tokens": 32}
    data["eval"] |= {"n": 16, "batch_size": 16}
    return data


def layer_bytes(student: dict) -> int:
    head_dim = student["d_model"] // student["n_heads"]
    attention = 2 * student["d_model"] * head_dim * (student["n_heads"] + student["n_kv_heads"])
    return 2 * (attention + 3 * student["d_model"] * student["d_ff"])  # bfloat16


def all_gathers(hlo: str) -> dict[str, int]:
    """All-gathers in the entry computation and in every other computation (loop bodies, fusions)."""
    counts, entry = {"entry": 0, "elsewhere": 0}, False
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            entry = line.startswith("ENTRY")
        if re.search(r"= \S+ all-gather(-start)?\(", line):
            counts["entry" if entry else "elsewhere"] += 1
    return counts


def main() -> None:
    mesh = make_plan_mesh({"data": 1, "fsdp": 8, "model": 1}, topology("v5e:2x4"))
    rows = []
    for layers in (4, 8):
        data = preset(layers)
        [decoding] = [p for p in stage_lowered(data, "sft-student", mesh) if p.program == "held-out decoding"]
        compiled = decoding.lowered.compile()
        row = {"layers": layers, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
               "layers_weight_bytes": layers * layer_bytes(data["student"]),
               "all_gathers": all_gathers(compiled.as_text())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_results("decode_gather", {"mesh": "v5e:2x4, fsdp 8", "model": WIDE, "rows": rows})


if __name__ == "__main__":
    main()
