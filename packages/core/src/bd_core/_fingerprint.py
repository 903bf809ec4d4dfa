"""Config fingerprints: a canonical hash over named fields, kept with the values it hashes.

Canonical JSON: sorted keys, tuples as lists, integral floats as ints (so 1 and 1.0 agree), numpy
scalars and arrays as Python values. A mismatch names every differing field with both values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

FINGERPRINT_VERSION = 1
_MISSING = "<missing>"


class FingerprintMismatch(ValueError):
    """Two fingerprints that should agree differ; `differences` maps field -> (saved, current)."""

    def __init__(self, differences: Mapping[str, tuple[Any, Any]], context: str = ""):
        self.differences = dict(differences)
        lines = [f"  {key}: saved {saved!r}, current {current!r}"
                 for key, (saved, current) in sorted(self.differences.items())]
        head = f"{context}: " if context else ""
        super().__init__(
            f"{head}fingerprint mismatch in {len(lines)} field(s):\n" + "\n".join(lines)
            + "\nStart from a checkpoint made with the same settings, or change the config to match it."
        )


def canonical(value: Any) -> Any:
    """The canonical JSON-ready form of a config value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else repr(value)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        return canonical(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return canonical({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    raise TypeError(f"fingerprint: cannot canonicalize a {type(value).__name__} ({value!r}); use plain config values")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A canonical set of fields and the SHA-256 digest of their JSON form: what a checkpoint's config means, compared
    field by field on restore.

    Attributes:
        digest: hex SHA-256 of the canonical JSON of `fields` and `version`.
        fields: the canonical fields (nested dicts of JSON values).
        version: the fingerprint format's version; digests of different versions never match."""
    digest: str
    fields: dict[str, Any]
    version: int = FINGERPRINT_VERSION

    def diff(self, other: Fingerprint) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ (or exist on one side only): key -> (self's, other's). Nested
        tables are compared key by key and named by dotted path (`architecture.d_model`)."""
        out = _diff(self.fields, other.fields, "")
        if self.version != other.version:
            out["<fingerprint version>"] = (self.version, other.version)
        return out

    def to_json(self) -> dict[str, Any]:
        """The fingerprint as a JSON-ready dict (`digest`, `fields`, `version`), as checkpoints store it."""
        return {"digest": self.digest, "fields": self.fields, "version": self.version}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fingerprint:
        """The fingerprint `to_json` wrote; a malformed record raises `ValueError` naming the keys it needs."""
        try:
            return cls(digest=str(data["digest"]), fields=dict(data["fields"]), version=int(data["version"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed fingerprint record {data!r}: expected keys digest, fields, version") from err


def fingerprint(fields: Mapping[str, Any], *, version: int = FINGERPRINT_VERSION) -> Fingerprint:
    """The `Fingerprint` of `fields`: canonicalized (sorted keys, tuples as lists, floats exact), then hashed.

    Args:
        fields: JSON-like values (dicts, lists, tuples, numbers, strings, None, dataclasses).
        version: the fingerprint format's version.

    Returns:
        The fingerprint; equal fields give equal digests in every process.

    Example:
        ```python
        from bd_core import fingerprint

        fp = fingerprint({"block_size": 4, "mask_id": 257})
        assert fp.diff(fingerprint({"block_size": 8, "mask_id": 257})) == {"block_size": (4, 8)}
        ```"""
    canon = canonical(dict(fields))
    payload = json.dumps({"fields": canon, "version": version}, sort_keys=True, separators=(",", ":"))
    return Fingerprint(hashlib.sha256(payload.encode()).hexdigest(), canon, version)


def _diff(mine: dict[str, Any], theirs: dict[str, Any], prefix: str) -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key, _MISSING), theirs.get(key, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_diff(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return out


def require_compatible(saved: Fingerprint, current: Fingerprint, keys: Iterable[str] | None = None,
                       *, context: str = "") -> None:
    """Raise `FingerprintMismatch` naming every differing field (restricted to `keys` if given)."""
    differences = saved.diff(current)
    if keys is not None:
        wanted = set(keys)
        differences = {k: v for k, v in differences.items() if k.split(".")[0] in wanted}
    if differences:
        raise FingerprintMismatch(differences, context)
