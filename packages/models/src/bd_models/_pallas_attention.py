"""Block-diffusion attention with its forward pass as a Pallas kernel (`attention="pallas"`).

One program per (batch row, query head, query tile): it reads its query tile and walks only the
key tiles that the shared tile plan (`_tile_plan`, the one `blocked` uses) marks as needed for
that query tile, builds the block-diffusion mask from the tokens' view ids, block ids and
validity inside the kernel, and keeps the online-softmax state (running max, sum, output) in
float32. It writes the output and the log-sum-exp; the backward pass is `blocked`'s (XLA) flash
backward from exactly these residuals, so `pallas` trains like `blocked` up to float reassociation.

Where it runs: on GPU the kernel lowers through Pallas' Triton backend; on CPU it runs in Pallas'
interpret mode, which is correct but slow (what the equality tests use); TPU is refused (its
Mosaic backend needs another tiling). The dense and blocked kernels stay the references.
Shape letters: see bd_core (B, K, G, H = K·G, T, S, E; Q query tile, U key tile, I, J tile counts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bd_core import CLEAN_VIEW, TokenMeta

from ._attention import _flash_bwd, _tile, _tile_plan

Array = jax.Array


def _kernel(order_ref, count_ref, q_ref, k_ref, v_ref, q_view_ref, q_block_ref, q_valid_ref, k_view_ref,
            k_block_ref, k_valid_ref, out_ref, lse_ref, *, k_tile: int):
    i = pl.program_id(2)
    q_QxE = q_ref[...]
    q_view, q_block, q_valid = q_view_ref[...][:, None], q_block_ref[...][:, None], q_valid_ref[...][:, None] != 0

    def body(n, state):
        m_Q, l_Q, acc_QxE = state
        start = order_ref[i, n] * k_tile
        keys = pl.ds(start, k_tile)
        k_view, k_block = k_view_ref[keys][None, :], k_block_ref[keys][None, :]
        allowed_QxU = q_valid & (k_valid_ref[keys][None, :] != 0) & (
            ((k_view == CLEAN_VIEW) & (k_block < q_block)) | ((k_view == q_view) & (k_block == q_block)))
        s_QxU = jnp.dot(q_QxE, k_ref[keys, :].T, preferred_element_type=jnp.float32)
        s_QxU = jnp.where(allowed_QxU, s_QxU, -jnp.inf)
        m_new = jnp.maximum(m_Q, jnp.max(s_QxU, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p_QxU = jnp.exp(s_QxU - m_safe[:, None])
        correction = jnp.exp(m_Q - m_safe)
        pv_QxE = jnp.dot(p_QxU.astype(v_ref.dtype), v_ref[keys, :], preferred_element_type=jnp.float32)
        return m_new, l_Q * correction + jnp.sum(p_QxU, axis=-1), acc_QxE * correction[:, None] + pv_QxE

    q_tile, e = q_QxE.shape
    init = (jnp.full((q_tile,), -jnp.inf, jnp.float32), jnp.zeros((q_tile,), jnp.float32),
            jnp.zeros((q_tile, e), jnp.float32))
    m_Q, l_Q, acc_QxE = lax.fori_loop(0, count_ref[i], body, init)
    has_keys = l_Q > 0
    safe_l = jnp.where(has_keys, l_Q, 1.0)
    out_ref[...] = (acc_QxE / safe_l[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(has_keys, m_Q + jnp.log(safe_l), 0.0)


def _interpret() -> bool:
    backend = jax.default_backend()
    if backend == "tpu":
        raise ValueError("attention='pallas' runs on GPU (Triton) or, for tests, in interpret mode on CPU; on TPU "
                         "use attention='blocked' or 'shard_map'")
    return backend != "gpu"


def _pallas_forward(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, q_tile: int,
                    k_tile: int):
    b, kh, g, t, e = q_BxKxGxTxE.shape
    s = k_BxKxSxE.shape[2]
    order_IxJ, count_I = _tile_plan(q_meta, k_meta, q_tile, k_tile)
    n_i, n_j = order_IxJ.shape
    q_BxHxTxE = q_BxKxGxTxE.reshape(b, kh * g, t, e)  # query head h reads kv head h // g
    as_int = lambda meta: (meta.view_ids.astype(jnp.int32), meta.block_ids.astype(jnp.int32),  # noqa: E731
                           meta.valid.astype(jnp.int32))
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    q_rows = pl.BlockSpec((None, q_tile), lambda r, h, i: (r, i))
    k_rows = pl.BlockSpec((None, s), lambda r, h, i: (r, 0))
    out, lse = pl.pallas_call(
        functools.partial(_kernel, k_tile=k_tile),
        grid=(b, kh * g, n_i),
        in_specs=[whole((n_i, n_j)), whole((n_i,)),
                  pl.BlockSpec((None, None, q_tile, e), lambda r, h, i: (r, h, i, 0)),
                  pl.BlockSpec((None, None, s, e), lambda r, h, i: (r, h // g, 0, 0)),
                  pl.BlockSpec((None, None, s, e), lambda r, h, i: (r, h // g, 0, 0)),
                  q_rows, q_rows, q_rows, k_rows, k_rows, k_rows],
        out_specs=[pl.BlockSpec((None, None, q_tile, e), lambda r, h, i: (r, h, i, 0)),
                   pl.BlockSpec((None, None, q_tile), lambda r, h, i: (r, h, i))],
        out_shape=[jax.ShapeDtypeStruct((b, kh * g, t, e), q_BxKxGxTxE.dtype),
                   jax.ShapeDtypeStruct((b, kh * g, t), jnp.float32)],
        interpret=_interpret(),
    )(order_IxJ, count_I, q_BxHxTxE, k_BxKxSxE, v_BxKxSxE, *as_int(q_meta), *as_int(k_meta))
    return out.reshape(b, kh, g, t, e), lse.reshape(b, kh, g, t), (order_IxJ, count_I)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pallas_flash(q, k, v, q_meta, k_meta, q_tile, k_tile):
    return _pallas_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)[0]


def _pallas_flash_fwd(q, k, v, q_meta, k_meta, q_tile, k_tile):
    out, lse, plan = _pallas_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)
    return out, (q, k, v, q_meta, k_meta, out, lse, plan)


_pallas_flash.defvjp(_pallas_flash_fwd, _flash_bwd)


def pallas_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, *,
                     q_tile: int = 64, k_tile: int = 64) -> Array:
    """`blocked_attention` with the forward as a Pallas kernel; equals `dense_attention`."""
    t, s = q_BxKxGxTxE.shape[3], k_BxKxSxE.shape[2]
    q_tile, t_pad = _tile(q_tile, t)
    k_tile, s_pad = _tile(k_tile, s)
    pad = lambda x, n, axis: jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    q = pad(q_BxKxGxTxE, t_pad - t, 3)
    k, v = pad(k_BxKxSxE, s_pad - s, 2), pad(v_BxKxSxE, s_pad - s, 2)
    out = _pallas_flash(q, k, v, q_meta.pad_to(t_pad), k_meta.pad_to(s_pad), q_tile, k_tile)
    return out[:, :, :, :t]  # pyright: ignore[reportIndexIssue]
