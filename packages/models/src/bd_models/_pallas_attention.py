"""Block-diffusion attention as Pallas kernels, forward and backward (`attention="pallas"`).

One program per (batch row, query head, query tile): it reads its query tile and walks only the
key tiles that the tile plan (`tile_needed`, as `blocked` uses it) marks as needed for
that query tile, builds the block-diffusion mask from the tokens' view ids, block ids and
validity inside the kernel, and keeps the online-softmax state (running max, sum, output) in
float32. It writes the output and the log-sum-exp. The backward pass is two more kernels that
recompute the probabilities from the log-sum-exp: `dq` per (row, query head, query tile) over the
same planned key tiles, and `dk`/`dv` per (row, kv head, key tile) over the query tiles that need
that key tile (the transposed plan) and the kv head's query heads, so nothing is accumulated
across programs.

Where it runs: the backend is chosen when the program is lowered, for the platform it is lowered
for (`lax.platform_dependent`): Pallas' Triton backend on GPU (named explicitly: JAX otherwise
sends `pallas_call` to Mosaic GPU, which these kernels are not written for), interpret mode on
CPU, which is correct but slow (what the equality tests use). On a CPU host the GPU program can
still be lowered (`jit(...).trace(...).lower(lowering_platforms=("cuda",))`), which runs the
Triton lowering of all three kernels, as a test does; compiling them to GPU code needs a GPU.
Triton wants power-of-two shapes inside a kernel: the head dim is zero-padded to the next power
of two, at least 16, which leaves the scores and the output exact (`ModelConfig` requires
power-of-two tiles with `attention="pallas"`). TPU is refused (its Mosaic backend needs another
tiling). The dense and blocked kernels stay the references.
Shape letters: see bd_core (B, K, G, H = K·G, T, S, E; Q query tile, U key tile, I, J tile counts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bd_core import CLEAN_VIEW, TokenMeta

from ._attention import tiled
from ._mask import needed_first, tile_needed

Array = jax.Array


def _allowed(q_view, q_block, q_valid, k_view, k_block, k_valid) -> Array:
    """The block-diffusion rule (bd_core.allowed) for a `[Q]` query and a `[U]` key slice of int32
    view ids, block ids and validity: `[Q, U]` bool."""
    q_view, q_block, q_valid = q_view[:, None], q_block[:, None], q_valid[:, None] != 0
    k_view, k_block, k_valid = k_view[None, :], k_block[None, :], k_valid[None, :] != 0
    return q_valid & k_valid & (((k_view == CLEAN_VIEW) & (k_block < q_block))
                                | ((k_view == q_view) & (k_block == q_block)))


def _kernel(order_ref, count_ref, q_ref, k_ref, v_ref, q_view_ref, q_block_ref, q_valid_ref, k_view_ref,
            k_block_ref, k_valid_ref, out_ref, lse_ref, *, k_tile: int):
    i = pl.program_id(2)
    q_QxE = q_ref[...]
    q_meta = (q_view_ref[...], q_block_ref[...], q_valid_ref[...])

    def body(n, state):
        m_Q, l_Q, acc_QxE = state
        keys = pl.ds(order_ref[i, n] * k_tile, k_tile)
        allowed_QxU = _allowed(*q_meta, k_view_ref[keys], k_block_ref[keys], k_valid_ref[keys])
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


def _dq_kernel(order_ref, count_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, q_view_ref, q_block_ref,
               q_valid_ref, k_view_ref, k_block_ref, k_valid_ref, dq_ref, *, k_tile: int):
    i = pl.program_id(2)
    q_QxE, do_QxE = q_ref[...], do_ref[...].astype(jnp.float32)
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    q_meta = (q_view_ref[...], q_block_ref[...], q_valid_ref[...])

    def body(n, dq_QxE):
        keys = pl.ds(order_ref[i, n] * k_tile, k_tile)
        allowed_QxU = _allowed(*q_meta, k_view_ref[keys], k_block_ref[keys], k_valid_ref[keys])
        k_UxE = k_ref[keys, :]
        s_QxU = jnp.where(allowed_QxU, jnp.dot(q_QxE, k_UxE.T, preferred_element_type=jnp.float32), -jnp.inf)
        p_QxU = jnp.exp(s_QxU - lse_Q[:, None])
        dp_QxU = jnp.dot(do_QxE, v_ref[keys, :].T.astype(jnp.float32), preferred_element_type=jnp.float32)
        ds_QxU = p_QxU * (dp_QxU - delta_Q[:, None])
        return dq_QxE + jnp.dot(ds_QxU, k_UxE.astype(jnp.float32), preferred_element_type=jnp.float32)

    dq_QxE = lax.fori_loop(0, count_ref[i], body, jnp.zeros(q_QxE.shape, jnp.float32))
    dq_ref[...] = dq_QxE.astype(dq_ref.dtype)


def _dkv_kernel(order_ref, count_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, q_view_ref, q_block_ref,
                q_valid_ref, k_view_ref, k_block_ref, k_valid_ref, dk_ref, dv_ref, *, q_tile: int, g: int):
    j = pl.program_id(2)
    k_UxE, v_UxE = k_ref[...], v_ref[...]
    k_meta = (k_view_ref[...], k_block_ref[...], k_valid_ref[...])

    def body(n, state):
        dk_UxE, dv_UxE = state
        queries = pl.ds(order_ref[j, n] * q_tile, q_tile)
        allowed_QxU = _allowed(q_view_ref[queries], q_block_ref[queries], q_valid_ref[queries], *k_meta)
        for head in range(g):  # the kv head's query heads
            q_QxE, do_QxE = q_ref[head, queries, :], do_ref[head, queries, :].astype(jnp.float32)
            s_QxU = jnp.where(allowed_QxU, jnp.dot(q_QxE, k_UxE.T, preferred_element_type=jnp.float32), -jnp.inf)
            p_QxU = jnp.exp(s_QxU - lse_ref[head, queries][:, None])
            dv_UxE = dv_UxE + jnp.dot(p_QxU.T, do_QxE, preferred_element_type=jnp.float32)
            dp_QxU = jnp.dot(do_QxE, v_UxE.T.astype(jnp.float32), preferred_element_type=jnp.float32)
            ds_QxU = p_QxU * (dp_QxU - delta_ref[head, queries][:, None])
            dk_UxE = dk_UxE + jnp.dot(ds_QxU.T, q_QxE.astype(jnp.float32), preferred_element_type=jnp.float32)
        return dk_UxE, dv_UxE

    zeros = jnp.zeros(k_UxE.shape, jnp.float32)
    dk_UxE, dv_UxE = lax.fori_loop(0, count_ref[j], body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk_UxE.astype(dk_ref.dtype), dv_UxE.astype(dv_ref.dtype)


def _pallas_call(kernel, **kwargs):
    """`pl.pallas_call(kernel, **kwargs)` for the platform the program is lowered for: Triton on GPU,
    interpret mode on CPU (both staged; lowering keeps the one for its platform)."""
    if jax.default_backend() == "tpu":
        raise ValueError("attention='pallas' runs on GPU (Triton) or, for tests, in interpret mode on CPU; on TPU "
                         "use attention='blocked' or 'shard_map'")
    triton = pl.pallas_call(kernel, compiler_params=pltriton.CompilerParams(), **kwargs)
    interpreted = pl.pallas_call(kernel, interpret=True, **kwargs)
    return lambda *args: lax.platform_dependent(*args, cpu=interpreted, cuda=triton, rocm=triton)


def _plans(q_meta: TokenMeta, k_meta: TokenMeta, q_tile: int, k_tile: int):
    """The needed tiles, needed ones first: per query tile its key tiles (`order [I, J]`, `count
    [I]`) and, transposed, per key tile its query tiles (`[J, I]`, `[J]`)."""
    need_IxJ = tile_needed(q_meta, k_meta, q_tile, k_tile)
    return needed_first(need_IxJ), needed_first(need_IxJ.T)


def _ints(meta: TokenMeta) -> tuple[Array, Array, Array]:
    return meta.view_ids.astype(jnp.int32), meta.block_ids.astype(jnp.int32), meta.valid.astype(jnp.int32)


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _pallas_forward(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, q_tile: int,
                    k_tile: int):
    b, kh, g, t, e = q_BxKxGxTxE.shape
    s = k_BxKxSxE.shape[2]
    (order_IxJ, count_I), _ = _plans(q_meta, k_meta, q_tile, k_tile)
    n_i, n_j = order_IxJ.shape
    q_tiles = pl.BlockSpec((None, None, q_tile, e), lambda r, h, i: (r, h, i, 0))
    kv_whole = pl.BlockSpec((None, None, s, e), lambda r, h, i: (r, h // g, 0, 0))  # query head h reads kv head h // g
    q_rows = pl.BlockSpec((None, q_tile), lambda r, h, i: (r, i))
    k_rows = pl.BlockSpec((None, s), lambda r, h, i: (r, 0))
    out, lse = _pallas_call(
        functools.partial(_kernel, k_tile=k_tile),
        grid=(b, kh * g, n_i),
        in_specs=[_whole((n_i, n_j)), _whole((n_i,)), q_tiles, kv_whole, kv_whole, *[q_rows] * 3, *[k_rows] * 3],
        out_specs=[q_tiles, pl.BlockSpec((None, None, q_tile), lambda r, h, i: (r, h, i))],
        out_shape=[jax.ShapeDtypeStruct((b, kh * g, t, e), q_BxKxGxTxE.dtype),
                   jax.ShapeDtypeStruct((b, kh * g, t), jnp.float32)],
    )(order_IxJ, count_I, q_BxKxGxTxE.reshape(b, kh * g, t, e), k_BxKxSxE, v_BxKxSxE, *_ints(q_meta), *_ints(k_meta))
    return out.reshape(b, kh, g, t, e), lse.reshape(b, kh, g, t)


def _pallas_backward(q_tile: int, k_tile: int, residuals, dout_BxKxGxTxE):
    q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, out, lse_BxKxGxT = residuals
    b, kh, g, t, e = q_BxKxGxTxE.shape
    s, h = k_BxKxSxE.shape[2], kh * g
    (order_IxJ, count_I), (order_JxI, count_J) = _plans(q_meta, k_meta, q_tile, k_tile)
    n_i, n_j = order_IxJ.shape
    delta_BxHxT = jnp.sum(dout_BxKxGxTxE.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).reshape(b, h, t)
    per_head = (q_BxKxGxTxE.reshape(b, h, t, e), dout_BxKxGxTxE.reshape(b, h, t, e), lse_BxKxGxT.reshape(b, h, t),
                delta_BxHxT)
    metas = (*_ints(q_meta), *_ints(k_meta))

    q_tiles = pl.BlockSpec((None, None, q_tile, e), lambda r, hh, i: (r, hh, i, 0))
    row_tiles = pl.BlockSpec((None, None, q_tile), lambda r, hh, i: (r, hh, i))
    kv_whole = pl.BlockSpec((None, None, s, e), lambda r, hh, i: (r, hh // g, 0, 0))
    dq = _pallas_call(
        functools.partial(_dq_kernel, k_tile=k_tile),
        grid=(b, h, n_i),
        in_specs=[_whole((n_i, n_j)), _whole((n_i,)), q_tiles, q_tiles, row_tiles, row_tiles, kv_whole, kv_whole,
                  *[pl.BlockSpec((None, q_tile), lambda r, hh, i: (r, i))] * 3,
                  *[pl.BlockSpec((None, s), lambda r, hh, i: (r, 0))] * 3],
        out_specs=q_tiles,
        out_shape=jax.ShapeDtypeStruct((b, h, t, e), q_BxKxGxTxE.dtype),
    )(order_IxJ, count_I, *per_head, k_BxKxSxE, v_BxKxSxE, *metas)

    group = pl.BlockSpec((None, g, t, e), lambda r, c, j: (r, c, 0, 0))  # kv head c's query heads
    group_rows = pl.BlockSpec((None, g, t), lambda r, c, j: (r, c, 0))
    kv_tiles = pl.BlockSpec((None, None, k_tile, e), lambda r, c, j: (r, c, j, 0))
    dk, dv = _pallas_call(
        functools.partial(_dkv_kernel, q_tile=q_tile, g=g),
        grid=(b, kh, n_j),
        in_specs=[_whole((n_j, n_i)), _whole((n_j,)), group, group, group_rows, group_rows, kv_tiles, kv_tiles,
                  *[pl.BlockSpec((None, t), lambda r, c, j: (r, 0))] * 3,
                  *[pl.BlockSpec((None, k_tile), lambda r, c, j: (r, j))] * 3],
        out_specs=[kv_tiles, kv_tiles],
        out_shape=[jax.ShapeDtypeStruct(k_BxKxSxE.shape, k_BxKxSxE.dtype),
                   jax.ShapeDtypeStruct(v_BxKxSxE.shape, v_BxKxSxE.dtype)],
    )(order_JxI, count_J, *per_head, k_BxKxSxE, v_BxKxSxE, *metas)
    return dq.reshape(b, kh, g, t, e), dk, dv, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pallas_flash(q, k, v, q_meta, k_meta, q_tile, k_tile):
    return _pallas_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)[0]


def _pallas_flash_fwd(q, k, v, q_meta, k_meta, q_tile, k_tile):
    out, lse = _pallas_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)
    return out, (q, k, v, q_meta, k_meta, out, lse)


_pallas_flash.defvjp(_pallas_flash_fwd, _pallas_backward)


def _pad_head_dim(x, e: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, e - x.shape[-1])])


def pallas_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, *,
                     q_tile: int = 64, k_tile: int = 64) -> Array:
    """`blocked_attention` as Pallas kernels (forward and backward); equals `dense_attention`. The
    head dim runs zero-padded to a power of two (at least 16): zero lanes add exact zeros to the
    scores, and the output's extra lanes are cropped."""
    e = q_BxKxGxTxE.shape[-1]
    e_pad = max(16, 1 << (e - 1).bit_length())
    q, k, v = (_pad_head_dim(x, e_pad) for x in (q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE))
    return tiled(_pallas_flash, q, k, v, q_meta, k_meta, q_tile, k_tile)[..., :e]
