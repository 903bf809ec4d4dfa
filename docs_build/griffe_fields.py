"""A griffe extension for the API reference: a class's fields become one table in the class.

Every public attribute of a class (dataclass fields, Equinox fields, class constants) moves into
the class docstring's `Attributes:` section with its type and its description (the `Attributes:`
entry already there, else the attribute's own docstring), and is no longer rendered as a heading
of its own. Equinox modules get the `__init__` signature their fields imply, as dataclasses do.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Attribute, Class, Docstring, Extension, Function, Module, Parameter, ParameterKind, Parameters

_SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Examples?|Notes?|Warns?|Warnings?"
                      r"|See Also|Other Parameters|Parameters|Methods|Classes|Functions|Modules):\s*$")
_ENTRY = re.compile(r"^(\w+)(?:\s*\(([^)]*)\))?:\s*(.*)$")


def _attributes_section(text: str) -> tuple[list[str], dict[str, str], int | None]:
    """The docstring's lines without its `Attributes:` section, that section's entries, and where it was."""
    lines = text.splitlines()
    out: list[str] = []
    entries: dict[str, str] = {}
    where = None
    i = 0
    while i < len(lines):
        if lines[i].strip() == "Attributes:" and not lines[i].startswith(" "):
            where = len(out)
            i += 1
            current = None
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                line = lines[i]
                stripped = line.strip()
                indent = len(line) - len(line.lstrip())
                match = _ENTRY.match(stripped)
                if match and indent <= 4:
                    current = match.group(1)
                    entries[current] = match.group(3)
                elif current and stripped:
                    entries[current] += " " + stripped
                i += 1
            continue
        out.append(lines[i])
        i += 1
    return out, entries, where


def _is_equinox(cls: Class) -> bool:
    try:
        mro = cls.mro()
    except Exception:
        return False
    return any(p.canonical_path.startswith("equinox.") for p in mro) or any(
        str(getattr(b, "canonical_path", b)).startswith("equinox.") for b in cls.bases)


def _field_default(attr: Attribute) -> Any:
    value = attr.value
    text = str(value) if value is not None else None
    if text and re.match(r"^(eqx|equinox)\.field\(", text):
        match = re.search(r"default=([^,()]+(?:\([^)]*\))?)", text)
        factory = re.search(r"default_factory=([\w.]+)", text)
        if match:
            return match.group(1)
        if factory:
            return f"{factory.group(1)}()"
        return None
    return value


def _fields(cls: Class) -> list[Attribute]:
    return [m for m in cls.members.values()
            if not m.is_alias and isinstance(m, Attribute) and not m.name.startswith("_")]


def _equinox_init(cls: Class) -> None:
    """`__init__(self, field, ...)` for an Equinox module that does not write its own."""
    params = []
    for parent in reversed(cls.mro()):
        if parent.canonical_path.startswith("equinox.") or "__init__" in parent.members:
            continue
        params.extend(f for f in _fields(parent) if f.annotation is not None and "instance-attribute" in f.labels)
    params.extend(f for f in _fields(cls) if f.annotation is not None and "instance-attribute" in f.labels)
    seen: dict[str, Attribute] = {f.name: f for f in params}
    required = [f for f in seen.values() if _field_default(f) is None]
    optional = [f for f in seen.values() if _field_default(f) is not None]
    cls.set_member("__init__", Function(
        "__init__", lineno=0, endlineno=0, parent=cls, returns="None",
        parameters=Parameters(
            Parameter("self", kind=ParameterKind.positional_or_keyword),
            *(Parameter(f.name, annotation=f.annotation, kind=ParameterKind.positional_or_keyword,
                        default=_field_default(f)) for f in required + optional))))


def fold_fields(cls: Class, parser: Any = None, options: dict | None = None) -> None:
    """Move the class's public attributes into its docstring's `Attributes:` table (parsed with
    `parser` and `options` unless the docstring names its own)."""
    if "__init__" not in cls.members and _is_equinox(cls):
        _equinox_init(cls)
    fields = _fields(cls)
    if not fields:
        return
    text = cls.docstring.value if cls.docstring else ""
    lines, entries, where = _attributes_section(text)
    table = ["Attributes:"]
    for attr in fields:
        description = entries.get(attr.name) or (" ".join(attr.docstring.value.split()) if attr.docstring else "")
        annotation = f" ({attr.annotation})" if attr.annotation is not None else ""
        table.append(f"    {attr.name}{annotation}: {description or '&nbsp;'}")
    for name in entries.keys() - {f.name for f in fields}:  # documented, but not a field here (a property)
        table.append(f"    {name}: {entries[name]}")
    if where is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *table]
    else:
        lines[where:where] = [*table, ""]
    old = cls.docstring
    cls.docstring = Docstring("\n".join(lines), parent=cls, lineno=old.lineno if old else None,
                              endlineno=old.endlineno if old else None,
                              parser=(old.parser if old and old.parser else parser),
                              parser_options=(old.parser_options if old and old.parser_options else options))
    for attr in fields:
        cls.del_member(attr.name)


def _walk(obj: Module | Class, seen: set[str], parser: Any, options: dict | None) -> None:
    if obj.canonical_path in seen:
        return
    seen.add(obj.canonical_path)
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        if isinstance(member, Class):
            _walk(member, seen, parser, options)
            fold_fields(member, parser, options)
        elif isinstance(member, Module):
            _walk(member, seen, parser, options)


class FieldTables(Extension):
    def on_package(self, *, pkg: Module, loader: Any = None, **kwargs: Any) -> None:
        # Dataclasses' `__init__` comes from their fields: make it before the fields move (griffe's
        # own extension skips a class that has one, so running it first again changes nothing).
        from griffe._internal.extensions.dataclasses import _apply_recursively

        _apply_recursively(pkg, set())
        _walk(pkg, set(), getattr(loader, "docstring_parser", None), getattr(loader, "docstring_options", None))
