"""The attention rule against DESIGN.md's three rules, written out as a brute-force loop."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bd_core import CLEAN_VIEW, TokenMeta, ViewLayout, allowed, attention_allowed


def brute_force(q: TokenMeta, k: TokenMeta) -> np.ndarray:
    """Query t may attend key s iff both are valid and one of DESIGN.md's rules holds."""
    qv, qb, qok = (np.asarray(a) for a in q)
    kv, kb, kok = (np.asarray(a) for a in k)
    out = np.zeros((qv.shape[0], qv.shape[1], kv.shape[1]), bool)
    for r in range(qv.shape[0]):
        for t in range(qv.shape[1]):
            for s in range(kv.shape[1]):
                rule1 = kv[r, s] == CLEAN_VIEW and kb[r, s] < qb[r, t]
                rule2 = qv[r, t] == kv[r, s] == CLEAN_VIEW and kb[r, s] == qb[r, t]
                rule3 = qv[r, t] == kv[r, s] > CLEAN_VIEW and kb[r, s] == qb[r, t]
                out[r, t, s] = bool(qok[r, t] and kok[r, s] and (rule1 or rule2 or rule3))
    return out


@st.composite
def metas(draw, rows: int, length: int) -> TokenMeta:
    ids = lambda high: st.lists(st.integers(0, high), min_size=rows * length, max_size=rows * length)  # noqa: E731
    shape = (rows, length)
    view_ids = np.asarray(draw(ids(3)), np.int32).reshape(shape)
    block_ids = np.asarray(draw(ids(3)), np.int32).reshape(shape)
    valid = np.asarray(draw(st.lists(st.booleans(), min_size=rows * length, max_size=rows * length))).reshape(shape)
    return TokenMeta(view_ids, block_ids, valid)


@st.composite
def pairs(draw):
    rows, t, s = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 10))
    return draw(metas(rows, t)), draw(metas(rows, s))


@settings(max_examples=60, deadline=None)
@given(pairs())
def test_allowed_is_the_three_rules(pair):
    q, k = pair
    np.testing.assert_array_equal(np.asarray(allowed(q, k)), brute_force(q, k))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3).flatmap(lambda rows: st.integers(1, 12).flatmap(lambda t: metas(rows, t))))
def test_attention_allowed_is_the_rule_over_one_layout(meta):
    view_ids, block_ids, valid = meta
    layout = ViewLayout.create(np.zeros_like(view_ids), block_ids * 4, block_ids, view_ids, valid)
    mask = np.asarray(attention_allowed(layout))
    np.testing.assert_array_equal(mask, brute_force(meta, meta))
    # TokenMeta round-trips the layout, and invalid padding attends and is attended by nothing
    np.testing.assert_array_equal(np.asarray(allowed(*[TokenMeta.from_layout(layout)] * 2)), mask)
    padded = TokenMeta.from_layout(layout).pad_to(view_ids.shape[1] + 3)
    np.testing.assert_array_equal(np.asarray(allowed(padded, padded))[:, :view_ids.shape[1], :view_ids.shape[1]], mask)
    assert not np.asarray(allowed(padded, padded))[:, view_ids.shape[1]:].any()
    assert not np.asarray(allowed(padded, padded))[:, :, view_ids.shape[1]:].any()
