"""Block-diffusion attention with TPU's splash kernel (`attention="splash"`).

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) is JAX's block-sparse flash
attention for TPU, forward and backward as Mosaic kernels. It takes its mask either as a static
NumPy array or as a dynamic `[heads, T, S]` bool array. bdlm's rule cannot be static: the views of
a packed replay hold whatever block their denoising step was in, so which keys a query sees
depends on the row. Each row's mask is therefore `bd_core.allowed` of that row (one `[T, S]` mask
shared by every head), tiled by the kernel's own mask processing into the tiles it skips (empty),
runs without a mask (full) and masks (partial), and the kernel runs once per row (`vmap`).

Exact against `dense_attention`: rows with no allowed key (invalid tokens) must still see a key
in the kernel (its softmax needs one), so an invalid query is given its own position, and its
output is then set to exactly 0, as the reference's. Nothing flows back through those rows.
It is self-attention over one packed layout (queries and keys are the same tokens).

Where it runs: Mosaic on TPU, Pallas' interpret mode on CPU (correct, slow: what the equality
tests use); a GPU is refused (use `attention="pallas"`). The platform is chosen when the program
is lowered (`lax.platform_dependent`), so a CPU host compiles the TPU program ahead of time
(`bd_train.plan`). Tiles (`q_tile`, `k_tile`) are multiples of 128, TPU's lane width; the sequence
is right-padded to whole tiles with invalid tokens and the head dim zero-padded to a multiple of
128, which leaves scores and outputs exact. Memory beyond the kernel's: each row's `[T, S]` mask
and its tiled copies for the three kernels, bytes per entry, a few MB at 1-2k tokens.
Shape letters: see bd_core (B, K, G, H = K·G, T, E).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

from bd_core import TokenMeta, allowed

Array = jax.Array
LANES = 128  # TPU's vector lane width: splash's tiles and head dim are multiples of it


def _kernel(mask_1xTxT: Array, tiles: splash.BlockSizes, interpret: bool) -> splash.SplashAttentionKernel:
    """Splash's kernel for one row's dynamic mask. Built inside a traced function, its mask info
    would carry `is_dynamic_mask` as a traced array, which the kernel reads as a Python bool: it is
    put back."""
    made = splash.make_splash_mha(mask_1xTxT, block_sizes=tiles, head_shards=1, q_seq_shards=1, interpret=interpret)
    fwd, dq, dkv = (info._replace(is_dynamic_mask=True) if info is not None else None
                    for info in (made.fwd_mask_info, made.dq_mask_info, made.dkv_mask_info))
    assert fwd is not None
    return splash.SplashAttentionKernel(fwd, dq, dkv, **made.kwargs)


def _rows(q_BxHxTxE, k_BxKxTxE, v_BxKxTxE, mask_BxTxT, *, tiles: splash.BlockSizes, interpret: bool) -> Array:
    def one(q, k, v, mask) -> Array:
        out = _kernel(mask[None], tiles, interpret)(q, k, v)  # without save_residuals: the output alone
        assert isinstance(out, jax.Array)
        return out

    return jax.vmap(one)(q_BxHxTxE, k_BxKxTxE, v_BxKxTxE, mask_BxTxT)


def splash_attention(q_BxKxGxTxE, k_BxKxTxE, v_BxKxTxE, meta: TokenMeta, *, q_tile: int = 128,
                     k_tile: int = 128) -> Array:
    """Attention under the block-diffusion mask of `meta` by splash's TPU kernels; equals
    `dense_attention(q, k, v, meta, meta)` in value and gradient."""
    if jax.default_backend() == "gpu":
        raise ValueError("attention='splash' is TPU's kernel (and runs interpreted on CPU); on GPU use "
                         "attention='pallas' or 'shard_map'")
    for name, tile in (("q_tile", q_tile), ("k_tile", k_tile)):
        if tile % LANES:
            raise ValueError(f"attention='splash': {name}={tile} must be a multiple of {LANES} (TPU's lane width)")
    b, kh, g, t, e = q_BxKxGxTxE.shape
    if k_BxKxTxE.shape[2] != t:
        raise ValueError(f"attention='splash' is self-attention over one layout: {t} queries but "
                         f"{k_BxKxTxE.shape[2]} keys")
    whole = math.lcm(q_tile, k_tile)
    t_pad = -(-t // whole) * whole
    e_pad = -(-e // LANES) * LANES
    pad = lambda x, axis: jnp.pad(x, [(0, t_pad - t if a == axis else 0) for a in range(x.ndim - 1)]  # noqa: E731
                                  + [(0, e_pad - e)])
    meta = meta.pad_to(t_pad)
    # Invalid queries (padding included) see only themselves, so every row has a key.
    mask_BxTxT = allowed(meta, meta) | (jnp.eye(t_pad, dtype=jnp.bool_)[None] & ~meta.valid[:, :, None])
    q_BxHxTxE = pad(q_BxKxGxTxE, 3).reshape(b, kh * g, t_pad, e_pad)
    tiles = splash.BlockSizes(block_q=q_tile, block_kv=k_tile, block_kv_compute=k_tile, block_q_dkv=q_tile,
                              block_kv_dkv=k_tile, block_kv_dkv_compute=k_tile, block_q_dq=q_tile, block_kv_dq=k_tile)
    compiled = lambda *args: _rows(*args, tiles=tiles, interpret=False)  # noqa: E731
    interpreted = lambda *args: _rows(*args, tiles=tiles, interpret=True)  # noqa: E731
    out_BxHxTxE = lax.platform_dependent(q_BxHxTxE, pad(k_BxKxTxE, 2), pad(v_BxKxTxE, 2), mask_BxTxT,
                                         cpu=interpreted, tpu=compiled)
    out = out_BxHxTxE.reshape(b, kh, g, t_pad, e_pad) * meta.valid[:, None, None, :, None].astype(out_BxHxTxE.dtype)
    return out[:, :, :, :t, :e]
