"""Markdown generated from the code when the site is built, so that it cannot drift from it.

- `preset_tables()`: every table and key of a preset TOML, with type, default and meaning, from the
  config classes of `bd_train.stages.PipelineConfig` (the meaning is the class docstring's
  `Attributes:` entry of the field).
- `make_run_printout()`: the summary `make run` ends with, printed by `bd_train.stages.format_summary`
  from the committed `make_run_summary.json`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
_ENTRY = re.compile(r"^(\w+)(?:\s*\(([^)]*)\))?:\s*(.*)$")


def field_descriptions(cls) -> dict[str, str]:
    """The `Attributes:` section of a class docstring: field name -> its description on one line."""
    entries: dict[str, str] = {}
    inside, current = False, None
    for line in (inspect.getdoc(cls) or "").splitlines():
        if not line.startswith(" "):
            inside, current = line.strip() == "Attributes:", None
            continue
        if not inside:
            continue
        match = _ENTRY.match(line.strip())
        if match and len(line) - len(line.lstrip()) <= 4:
            current = match.group(1)
            entries[current] = match.group(3)
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


def class_summary(cls) -> str:
    """A class docstring's text before its sections, on one line."""
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses write when there is no docstring
        return ""
    return " ".join(doc.split("\nAttributes:")[0].split())


def _type_name(tp) -> str:
    text = str(tp).replace("typing.", "")
    if isinstance(tp, type):
        text = tp.__name__
    return re.sub(r"<class '([^']+)'>", r"\1", text).replace("NoneType", "None")


def _default(field: dataclasses.Field, table=None) -> str:
    """What a preset gets for `field` when it leaves the key out: its value in the table's own
    default (`table`: the table as the preset gets it when the whole table is left out), else the
    field's default."""
    if table is not None:
        value = getattr(table, field.name)
    elif field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(table below)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`"


def _inner_dataclass(tp):
    return next((a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)), None)


def preset_sections():
    """`(table path, config class, what the table is for, its default)` for every table of a
    preset, nested tables after their parent; the purpose is the parent's description of the field,
    and the default the table as a preset that leaves it out gets (None for a table that is off
    unless given, such as `lora`: its keys then default to the class's)."""
    from bd_train.stages import PipelineConfig

    out = []

    def walk(prefix: str, cls, purpose: str, table) -> None:
        out.append((prefix, cls, purpose, table))
        hints = typing.get_type_hints(cls)
        described = field_descriptions(cls)
        for field in dataclasses.fields(cls):
            inner = _inner_dataclass(hints[field.name])
            if inner is not None:
                value = getattr(table, field.name) if table is not None else None
                walk(f"{prefix}.{field.name}", inner, described.get(field.name, ""),
                     value if isinstance(value, inner) else None)

    hints = typing.get_type_hints(PipelineConfig)
    described = field_descriptions(PipelineConfig)
    defaults = PipelineConfig()
    for field in dataclasses.fields(PipelineConfig):
        walk(field.name, hints[field.name], described.get(field.name, ""), getattr(defaults, field.name))
    return out


def undocumented_keys() -> list[str]:
    """Every preset key whose config class gives it no description (a test keeps this empty)."""
    missing = []
    for prefix, cls, _, _ in preset_sections():
        described = field_descriptions(cls)
        missing += [f"[{prefix}] {f.name}" for f in dataclasses.fields(cls) if not described.get(f.name, "").strip()]
    return missing


def preset_tables() -> str:
    lines = []
    for prefix, cls, purpose, table in preset_sections():
        hints = typing.get_type_hints(cls)
        described = field_descriptions(cls)
        lines += [f"## `[{prefix}]`", ""]
        summary = class_summary(cls)
        if purpose:
            lines += [purpose[0].upper() + purpose[1:], ""]
        if summary:
            lines += [summary, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for field in dataclasses.fields(cls):
            kind, meaning = _type_name(hints[field.name]), described.get(field.name, "")
            lines.append(f"| `{field.name}` | `{kind}` | {_default(field, table)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def make_run_printout() -> str:
    from bd_train.stages import format_summary

    summary = json.loads((HERE / "make_run_summary.json").read_text())
    return "```\n" + format_summary(summary["summary"]) + "\n```\n"
