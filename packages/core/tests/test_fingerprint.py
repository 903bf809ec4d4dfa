"""Fingerprints are stable across key order and number spelling; mismatches name every field."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bd_core import Fingerprint, FingerprintMismatch, fingerprint, require_compatible

IDENTITY = {"block_size": 4, "mask_id": 257, "tokenizer": "bytes-v1", "arch": {"d_model": 64, "layers": 2}}


def test_key_order_and_number_spelling_do_not_change_the_digest():
    a = fingerprint({"b": (1, 2.0), "a": 1, "nested": {"y": 0.5, "x": np.int64(3)}})
    b = fingerprint({"a": 1.0, "nested": {"x": 3.0, "y": np.float32(0.5)}, "b": [1, 2]})
    assert a.digest == b.digest and a.fields == b.fields


@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers(-10**6, 10**6), max_size=6))
def test_integral_floats_and_ints_agree(fields):
    as_floats = {k: float(v) for k, v in fields.items()}
    reordered = dict(reversed(list(fields.items())))
    assert fingerprint(fields).digest == fingerprint(as_floats).digest == fingerprint(reordered).digest


def test_different_values_give_different_digests_and_bools_are_not_ints():
    assert fingerprint({"a": 1}).digest != fingerprint({"a": 2}).digest
    assert fingerprint({"a": True}).digest != fingerprint({"a": 1}).digest
    assert fingerprint({"a": 1}, version=2).digest != fingerprint({"a": 1}).digest


def test_mismatch_lists_every_differing_field_with_both_values():
    saved = fingerprint(IDENTITY)
    current = fingerprint({**IDENTITY, "block_size": 8, "tokenizer": "hf:abc", "extra": 1})
    with pytest.raises(FingerprintMismatch) as err:
        require_compatible(saved, current, context="teacher checkpoint")
    message = str(err.value)
    assert "teacher checkpoint" in message and "3 field(s)" in message
    assert "block_size: saved 4, current 8" in message
    assert "tokenizer: saved 'bytes-v1', current 'hf:abc'" in message
    assert "extra: saved '<missing>', current 1" in message
    assert set(err.value.differences) == {"block_size", "tokenizer", "extra"}


def test_require_compatible_can_restrict_to_keys():
    saved = fingerprint(IDENTITY)
    current = fingerprint({**IDENTITY, "arch": {"d_model": 32, "layers": 2}})
    require_compatible(saved, current, keys=["block_size", "mask_id"])
    with pytest.raises(FingerprintMismatch, match="arch"):
        require_compatible(saved, current, keys=["arch"])


def test_json_round_trip():
    fp = fingerprint(IDENTITY)
    assert Fingerprint.from_json(fp.to_json()) == fp
    with pytest.raises(ValueError, match="expected keys digest, fields, version"):
        Fingerprint.from_json({"digest": "x"})


def test_unsupported_values_are_named():
    with pytest.raises(TypeError, match="cannot canonicalize a object"):
        fingerprint({"a": object()})


def test_diff_names_nested_fields_by_path():
    saved = fingerprint({"architecture": {"d_model": 48, "n_layers": 2}, "block_size": 4})
    current = fingerprint({"architecture": {"d_model": 64, "n_layers": 2}, "block_size": 4})
    assert saved.diff(current) == {"architecture.d_model": (48, 64)}
    with pytest.raises(FingerprintMismatch, match=r"architecture\.d_model"):
        require_compatible(saved, current, ["architecture"])
    require_compatible(saved, current, ["block_size"])  # only the named keys are compared
