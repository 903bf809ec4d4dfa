"""MkDocs hooks: pages made at build time from the code and the repository, so they cannot drift.

- `reference/presets.md`: every preset key, its type and default, from the config classes of
  `bd_train.stages.PipelineConfig`.
- `benchmarks.md`, `scaling-details.md`: BENCHMARKS.md and SCALING.md as they are, their figures
  copied beside them.
- `assets/attention-mask.png`: the attention rule of an SFT layout, drawn from `bd_core`.
"""

from __future__ import annotations

import dataclasses
import io
import re
import typing
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RENAMES = {"BENCHMARKS.md": "benchmarks.md", "SCALING.md": "scaling-details.md", "README.md": "index.md"}


def _type_name(tp) -> str:
    text = str(tp).replace("typing.", "")
    if isinstance(tp, type):
        text = tp.__name__
    return re.sub(r"<class '([^']+)'>", r"\1", text).replace("NoneType", "None")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(table below)"
    return f"`{value!r}`"


def presets_page() -> str:
    from bd_train.stages import PipelineConfig

    lines = ["# Preset keys", "",
             "Every table of a preset TOML and its keys, generated from the frozen config classes of "
             "`bd_train.stages.PipelineConfig` when this site is built. Unknown keys, wrong types and broken "
             "invariants are refused on load, naming the key.", ""]

    def table(name: str, cls, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        out = [f"## `[{prefix}]` — `{cls.__name__}`", ""]
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [" ".join(doc.split()), ""]
        out += ["| key | type | default |", "|---|---|---|"]
        nested = []
        for field in dataclasses.fields(cls):
            tp = hints[field.name]
            out.append(f"| `{field.name}` | `{_type_name(tp)}` | {_default(field)} |")
            inner = next((a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)), None)
            if inner is not None:
                nested.append((field.name, inner))
        out.append("")
        for field_name, inner in nested:
            out += table(field_name, inner, f"{prefix}.{field_name}")
        return out

    hints = typing.get_type_hints(PipelineConfig)
    for field in dataclasses.fields(PipelineConfig):
        lines += table(field.name, hints[field.name], field.name)
    return "\n".join(lines) + "\n"


def _relink(text: str) -> str:
    """Links between the repository's markdown files point at their pages here; links to other
    repository files become plain code names."""
    def link(match):
        label, target = match.group(1), match.group(2)
        if target.startswith(("http://", "https://", "#")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        if path in RENAMES:
            return f"[{label}]({RENAMES[path]}{'#' + anchor if anchor else ''})"
        if path.startswith("bench/results/") and path.endswith(".png"):
            return f"[{label}](assets/{Path(path).name})"
        return label if label.startswith("`") else f"`{label}`"

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", link, re.sub(
        r"!\[([^\]]*)\]\((bench/results/[^)\s]+\.png)\)", lambda m: f"![{m.group(1)}](assets/{Path(m.group(2)).name})",
        text))


def mask_png() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from bd_core import ViewLayout, attention_allowed

    # A 4-token prompt (one block, its first token padding), an 8-token completion (blocks of 4),
    # then one noisy copy of the completion: BD3-LM's x_0 (+) x_t, as SFT packs it.
    b, prompt, new = 4, 4, 8
    clean = np.arange(prompt + new)
    positions = np.concatenate([clean, np.arange(prompt, prompt + new)])
    blocks = positions // b
    views = np.concatenate([np.zeros(prompt + new, int), np.ones(new, int)])
    valid = np.ones(len(positions), bool)
    valid[0] = False
    layout = ViewLayout(*(np.asarray(a)[None] for a in (positions, positions, blocks, views, valid)))
    allowed = np.asarray(attention_allowed(layout))[0]
    labels = [("pad" if not valid[i] else f"{'x0' if views[i] == 0 else 'xt'} b{blocks[i]}") for i in range(len(views))]
    fig, ax = plt.subplots(figsize=(6.4, 6.4))
    ax.imshow(allowed, cmap="Blues", vmin=0, vmax=1.4)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    for edge in (prompt + new - 0.5,):
        ax.axhline(edge, color="black", lw=1)
        ax.axvline(edge, color="black", lw=1)
    ax.set_xlabel("key (may be attended)")
    ax.set_ylabel("query")
    ax.set_title("SFT layout [clean prompt + completion | noisy completion]", fontsize=9)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def on_files(files, config):
    def add(uri: str, content: str | bytes) -> None:
        files.append(File.generated(config, uri, content=content))

    add("reference/presets.md", presets_page())
    add("benchmarks.md", _relink((ROOT / "BENCHMARKS.md").read_text()))
    add("scaling-details.md", _relink((ROOT / "SCALING.md").read_text()))
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        add(f"assets/{png.name}", png.read_bytes())
    add("assets/attention-mask.png", mask_png())
    return files
