"""Strict loading of nested frozen dataclasses from TOML/dicts, with errors that name the key.

Every config in bdlm is a frozen dataclass that validates itself on construction; this module
turns user text into them and turns every mistake (unknown key, wrong type, failed invariant)
into one `bd_core.ConfigError` naming the dotted key and what would fix it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from bd_core import ConfigError


def _origin(tp: Any) -> Any:
    return typing.get_origin(tp) or tp


def _check_type(value: Any, tp: Any, where: str, base: Any = None) -> Any:
    if tp is Any:
        return value
    origin = _origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is not None and len(options) == 1:  # an optional setting that is given: its own error
            return _check_type(value, options[0], where, base)
        errors = []
        for option in typing.get_args(tp):
            try:
                return _check_type(value, option, where, base)
            except ConfigError as err:
                errors.append(str(err))
        names = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp))
        raise ConfigError(f"{where}: expected {names}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected nothing (omit the key), got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where}: expected one of {list(typing.get_args(tp))}, got {value!r}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table of settings, got {value!r}")
        return build(tp, value, where, base=base if isinstance(base, tp) else None)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table (e.g. {{ key = value }}), got {value!r}")
        return dict(value)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp in (str, bool):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where}: expected a {tp.__name__}, got {value!r}")
    return value


def build(cls: type, data: Mapping[str, Any], where: str = "", *, base: Any = None) -> Any:
    """Construct dataclass `cls` from `data`, rejecting unknown keys and wrong types by name.

    A key `data` leaves out takes its value from `base` (a `cls` instance) where one is given, else
    the field's default. A table given in part is built on the value the table has when it is left
    out: `[grpo.optim] lr = 1e-4` keeps GRPO's own warm-up and schedule (`GRPOSection`'s default
    `optim`), not `OptimSection`'s."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key{'s ' + str(unknown) if len(unknown) > 1 else ''}; "
            f"valid keys for [{where or 'top level'}] are {sorted(fields)}"
        )
    def default(name: str) -> Any:  # what the field is when the table leaves it out
        if base is not None:
            return getattr(base, name)
        f = fields[name]
        return None if f.default is dataclasses.MISSING else f.default

    kwargs = {name: _check_type(value, hints[name], f"{prefix}{name}", default(name)) for name, value in data.items()}
    if base is not None:
        kwargs = {name: getattr(base, name) for name in fields} | kwargs
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: required key is missing from [{where or 'top level'}]")
    try:
        return cls(**kwargs)
    except ConfigError as err:  # names the field relative to the section, or as `<Class>.<field>`
        message = str(err).removeprefix(f"{cls.__name__}.")
        raise ConfigError(f"{prefix}{message}") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"[{where or 'top level'}] {err}") from err


def to_dict(config: Any) -> Any:
    """Plain JSON-ready values of a (nested) dataclass config."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config
