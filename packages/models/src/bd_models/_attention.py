"""Attention under the block-diffusion mask: `dense` (reference), `blocked`, `shard_map`,
`pallas` (`_pallas_attention.py`: `blocked` as Pallas kernels for GPU) and `splash`
(`_splash_attention.py`: TPU's splash kernels with the rule as a per-row mask); and `cached_attention`, dense
attention of a decoding chunk over a KV cache and itself.

`blocked` is an online-softmax (flash) kernel with a custom VJP: per query tile it loops only over
the key tiles that `tile_needed` marks, and its backward recomputes probabilities from the saved
log-sum-exp, so memory is O(T) and the masked half of the 2L training layout costs nothing.
Shape letters: see bd_core (B batch, K kv heads, G query heads per kv head, T queries, S keys,
E head dim, Q query tile, U key tile, I query tiles, J key tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from bd_core import TokenMeta, allowed

from ._mask import needed_first, tile_needed

Array = jax.Array
BATCH_AXES = ("data", "fsdp")
MODEL_AXIS = "model"


def _scores(q_BxKxGxQxE, k_BxKxUxE):
    return jnp.einsum("bkgqe,bkue->bkgqu", q_BxKxGxQxE, k_BxKxUxE, preferred_element_type=jnp.float32)


def _masked_softmax(s_BxKxGxTxS, mask_BxTxS):
    """Unnormalized probabilities under the mask and their row sums. The max only stabilizes exp;
    stopping its gradient leaves the result and gradient exact."""
    s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, -jnp.inf)
    m_BxKxGxT = lax.stop_gradient(jnp.max(s_BxKxGxTxS, axis=-1))
    m_BxKxGxT = jnp.where(jnp.isneginf(m_BxKxGxT), 0.0, m_BxKxGxT)
    p_BxKxGxTxS = jnp.exp(s_BxKxGxTxS - m_BxKxGxT[..., None])
    return p_BxKxGxTxS, jnp.sum(p_BxKxGxTxS, axis=-1)


def _pv(p_BxKxGxTxS, v_BxKxSxE):
    return jnp.einsum("bkgts,bkse->bkgte", p_BxKxGxTxS, v_BxKxSxE.astype(jnp.float32))


def _normalize(out_BxKxGxTxE, l_BxKxGxT, dtype):
    """Rows with no allowed key (sum 0) output exactly 0."""
    return (out_BxKxGxTxE / jnp.where(l_BxKxGxT > 0, l_BxKxGxT, 1.0)[..., None]).astype(dtype)


def dense_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta) -> Array:
    """The reference: full `[T, S]` scores. Rows with no allowed key output exactly 0."""
    p_BxKxGxTxS, l_BxKxGxT = _masked_softmax(_scores(q_BxKxGxTxE, k_BxKxSxE), allowed(q_meta, k_meta))
    return _normalize(_pv(p_BxKxGxTxS, v_BxKxSxE), l_BxKxGxT, q_BxKxGxTxE.dtype)


def cached_attention(q_BxKxGxTxE, kt_cache_BxKxExS, v_cache_BxKxSxE, cache_meta: TokenMeta, k_BxKxTxE, v_BxKxTxE,
                     q_meta: TokenMeta) -> Array:
    """`dense_attention` of a chunk's queries over the cache's keys followed by the chunk's own,
    without concatenating the keys: the two score blocks are joined instead. The chunk is a few
    tokens and the cache the whole canvas, so a decoding step reads the cache as stored (keys
    transposed, `[B, K, E, S]`) and copies nothing of it."""
    s = cache_meta.valid.shape[1]
    cache_scores = jnp.einsum("bkgqe,bkes->bkgqs", q_BxKxGxTxE, kt_cache_BxKxExS, preferred_element_type=jnp.float32)
    scores = jnp.concatenate([cache_scores, _scores(q_BxKxGxTxE, k_BxKxTxE)], axis=-1)
    mask = jnp.concatenate([allowed(q_meta, cache_meta), allowed(q_meta, q_meta)], axis=-1)
    p_BxKxGxTxST, l_BxKxGxT = _masked_softmax(scores, mask)
    out = _pv(p_BxKxGxTxST[..., :s], v_cache_BxKxSxE) + _pv(p_BxKxGxTxST[..., s:], v_BxKxTxE)
    return _normalize(out, l_BxKxGxT, q_BxKxGxTxE.dtype)


def _tile_plan(q_meta: TokenMeta, k_meta: TokenMeta, q_tile: int, k_tile: int):
    """Per query tile: the indices of the needed key tiles first (`order [I, J]`) and their count."""
    return needed_first(tile_needed(q_meta, k_meta, q_tile, k_tile))


def _split_q(x, n_tiles: int, axis: int):
    """Move query tiles to a leading scan axis: [..., T, ...] -> [I, ..., Q, ...]."""
    shape = x.shape[:axis] + (n_tiles, x.shape[axis] // n_tiles) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _merge_q(x, axis: int):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _key_tile(k_BxKxSxE, v_BxKxSxE, k_meta: TokenMeta, j, k_tile: int):
    start = j * k_tile
    k_t = lax.dynamic_slice_in_dim(k_BxKxSxE, start, k_tile, axis=2)
    v_t = lax.dynamic_slice_in_dim(v_BxKxSxE, start, k_tile, axis=2)
    return start, k_t, v_t, k_meta.slice(start, k_tile)


def _flash_forward(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, q_tile, k_tile):
    n_q = q_BxKxGxTxE.shape[3] // q_tile
    order_IxJ, count_I = _tile_plan(q_meta, k_meta, q_tile, k_tile)
    b, kh, g = q_BxKxGxTxE.shape[:3]

    def per_query_tile(_, xs):
        q_BxKxGxQxE, qm, order_J, count = xs

        def body(state):
            i, m_BxKxGxQ, l_BxKxGxQ, acc_BxKxGxQxE = state
            _, k_t, v_t, km = _key_tile(k_BxKxSxE, v_BxKxSxE, k_meta, order_J[i], k_tile)
            mask_Bx1x1xQxU = allowed(qm, km)[:, None, None]
            s_BxKxGxQxU = jnp.where(mask_Bx1x1xQxU, _scores(q_BxKxGxQxE, k_t), -jnp.inf)
            m_new = jnp.maximum(m_BxKxGxQ, jnp.max(s_BxKxGxQxU, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p_BxKxGxQxU = jnp.exp(s_BxKxGxQxU - m_safe[..., None])
            correction = jnp.exp(m_BxKxGxQ - m_safe)
            l_new = l_BxKxGxQ * correction + jnp.sum(p_BxKxGxQxU, axis=-1)
            pv = jnp.einsum("bkgqu,bkue->bkgqe", p_BxKxGxQxU.astype(v_t.dtype), v_t,
                            preferred_element_type=jnp.float32)
            return i + 1, m_new, l_new, acc_BxKxGxQxE * correction[..., None] + pv

        init = (jnp.int32(0), jnp.full((b, kh, g, q_tile), -jnp.inf, jnp.float32),
                jnp.zeros((b, kh, g, q_tile), jnp.float32), jnp.zeros(q_BxKxGxQxE.shape, jnp.float32))
        _, m_BxKxGxQ, l_BxKxGxQ, acc = lax.while_loop(lambda s: s[0] < count, body, init)
        has_keys = l_BxKxGxQ > 0
        out = acc / jnp.where(has_keys, l_BxKxGxQ, 1.0)[..., None]
        lse_BxKxGxQ = jnp.where(has_keys, m_BxKxGxQ + jnp.log(jnp.where(has_keys, l_BxKxGxQ, 1.0)), 0.0)
        return None, (out.astype(q_BxKxGxQxE.dtype), lse_BxKxGxQ)

    xs = (_split_q(q_BxKxGxTxE, n_q, 3), TokenMeta(*(_split_q(a, n_q, 1) for a in q_meta)), order_IxJ, count_I)
    _, (out_I, lse_I) = lax.scan(per_query_tile, None, xs)
    return _merge_q(out_I, 3), _merge_q(lse_I, 3), (order_IxJ, count_I)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, q_meta, k_meta, q_tile, k_tile):
    return _flash_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)[0]


def _flash_fwd(q, k, v, q_meta, k_meta, q_tile, k_tile):
    out, lse, plan = _flash_forward(q, k, v, q_meta, k_meta, q_tile, k_tile)
    return out, (q, k, v, q_meta, k_meta, out, lse, plan)


def _flash_bwd(q_tile, k_tile, residuals, dout_BxKxGxTxE):
    q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, out, lse_BxKxGxT, (order_IxJ, count_I) = residuals
    n_q = q_BxKxGxTxE.shape[3] // q_tile
    delta_BxKxGxT = jnp.sum(dout_BxKxGxTxE.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def per_query_tile(carry, xs):
        q_t, do_BxKxGxQxE, lse_BxKxGxQ, delta_BxKxGxQ, qm, order_J, count = xs

        def body(state):
            i, dq_BxKxGxQxE, dk_BxKxSxE, dv_BxKxSxE = state
            start, k_t, v_t, km = _key_tile(k_BxKxSxE, v_BxKxSxE, k_meta, order_J[i], k_tile)
            mask_Bx1x1xQxU = allowed(qm, km)[:, None, None]
            s_BxKxGxQxU = jnp.where(mask_Bx1x1xQxU, _scores(q_t, k_t), -jnp.inf)
            p_BxKxGxQxU = jnp.exp(s_BxKxGxQxU - lse_BxKxGxQ[..., None])
            dv_t = jnp.einsum("bkgqu,bkgqe->bkue", p_BxKxGxQxU, do_BxKxGxQxE, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqe,bkue->bkgqu", do_BxKxGxQxE, v_t, preferred_element_type=jnp.float32)
            ds_BxKxGxQxU = p_BxKxGxQxU * (dp - delta_BxKxGxQ[..., None])
            dq_BxKxGxQxE = dq_BxKxGxQxE + jnp.einsum("bkgqu,bkue->bkgqe", ds_BxKxGxQxU, k_t,
                                                     preferred_element_type=jnp.float32)
            dk_t = jnp.einsum("bkgqu,bkgqe->bkue", ds_BxKxGxQxU, q_t, preferred_element_type=jnp.float32)
            add = lambda acc, d: lax.dynamic_update_slice_in_dim(  # noqa: E731
                acc, lax.dynamic_slice_in_dim(acc, start, k_tile, axis=2) + d, start, axis=2)
            return i + 1, dq_BxKxGxQxE, add(dk_BxKxSxE, dk_t), add(dv_BxKxSxE, dv_t)

        init = (jnp.int32(0), jnp.zeros(q_t.shape, jnp.float32)) + carry
        _, dq_BxKxGxQxE, dk, dv = lax.while_loop(lambda s: s[0] < count, body, init)
        return (dk, dv), dq_BxKxGxQxE

    split = lambda x: _split_q(x, n_q, 3)  # noqa: E731
    xs = (split(q_BxKxGxTxE), split(dout_BxKxGxTxE), split(lse_BxKxGxT), split(delta_BxKxGxT),
          TokenMeta(*(_split_q(a, n_q, 1) for a in q_meta)), order_IxJ, count_I)
    zeros = (jnp.zeros(k_BxKxSxE.shape, jnp.float32), jnp.zeros(v_BxKxSxE.shape, jnp.float32))
    (dk, dv), dq_I = lax.scan(per_query_tile, zeros, xs)
    dq = _merge_q(dq_I, 3)
    return (dq.astype(q_BxKxGxTxE.dtype), dk.astype(k_BxKxSxE.dtype), dv.astype(v_BxKxSxE.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _tile(size: int, length: int) -> tuple[int, int]:
    """The tile for a length (no larger than it) and the length padded to a multiple of it."""
    tile = min(size, length)
    return tile, -(-length // tile) * tile


def tiled(kernel, q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, q_tile: int,
          k_tile: int) -> Array:
    """`kernel(q, k, v, q_meta, k_meta, q_tile, k_tile)` on queries and keys right-padded (with
    invalid tokens) to whole tiles, its output cropped back to the queries."""
    t, s = q_BxKxGxTxE.shape[3], k_BxKxSxE.shape[2]
    q_tile, t_pad = _tile(q_tile, t)
    k_tile, s_pad = _tile(k_tile, s)
    pad = lambda x, n, axis: jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    q = pad(q_BxKxGxTxE, t_pad - t, 3)
    k, v = pad(k_BxKxSxE, s_pad - s, 2), pad(v_BxKxSxE, s_pad - s, 2)
    out = kernel(q, k, v, q_meta.pad_to(t_pad), k_meta.pad_to(s_pad), q_tile, k_tile)
    return out[:, :, :, :t]


def blocked_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, *,
                      q_tile: int = 64, k_tile: int = 64) -> Array:
    """Flash attention over the key tiles the mask allows; equals `dense_attention`."""
    return tiled(_flash, q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, q_tile, k_tile)


def sharded_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, *,
                      q_tile: int = 64, k_tile: int = 64) -> Array:
    """`blocked_attention` under `jax.shard_map` on the mesh set with `jax.set_mesh`: batch over
    (`data`, `fsdp`), kv heads over `model`. Without a mesh it is `blocked_attention`."""
    kernel = functools.partial(blocked_attention, q_tile=q_tile, k_tile=k_tile)
    return on_mesh(kernel, "shard_map", q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta)


def on_mesh(kernel, name: str, q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta) -> Array:
    """`kernel(q, k, v, q_meta, k_meta)` per shard under `jax.shard_map` on the mesh set with
    `jax.set_mesh` (batch over `data` x `fsdp`, kv heads over `model`); without a mesh, once."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta)
    missing = {*BATCH_AXES, MODEL_AXIS} - set(mesh.axis_names)
    if missing:
        raise ValueError(f"attention={name!r} needs mesh axes {BATCH_AXES + (MODEL_AXIS,)}; the mesh lacks "
                         f"{sorted(missing)}. Build it with bd_models.make_mesh")
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    batch, kv_heads = q_BxKxGxTxE.shape[0], k_BxKxSxE.shape[1]
    if batch % n_batch:
        raise ValueError(f"attention={name!r}: the {batch} rows it is called with (a microbatch's, when a step is "
                         f"split into microbatches) are split over data*fsdp = {n_batch} devices, which must divide "
                         f"them; change the batch size, the microbatches or the mesh shape")
    if kv_heads % mesh.shape[MODEL_AXIS]:
        raise ValueError(f"attention={name!r}: n_kv_heads {kv_heads} must divide by model = "
                         f"{mesh.shape[MODEL_AXIS]}; change n_kv_heads or the mesh shape")
    q_spec, kv_spec, meta_spec = P(BATCH_AXES, MODEL_AXIS), P(BATCH_AXES, MODEL_AXIS), P(BATCH_AXES)
    # A TokenMeta of specs (a pytree prefix of the metas), not of arrays: `_make` takes any values.
    metas = TokenMeta._make((meta_spec, meta_spec, meta_spec))
    return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, metas, metas), out_specs=q_spec,
                         check_vma=False)(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta)


def attend(impl: str, q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta: TokenMeta, k_meta: TokenMeta, *,
           q_tile: int = 64, k_tile: int = 64) -> Array:
    """Attention under the block-diffusion mask by the implementation `ModelConfig.attention` names
    (`dense`, `blocked`, `shard_map`, `pallas` or `splash`; the Pallas kernels are imported on first
    use). `splash` is self-attention (`q_meta` is `k_meta`) and runs per shard on a mesh."""
    if impl == "dense":
        return dense_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta)
    if impl == "pallas":
        from ._pallas_attention import pallas_attention  # it imports this module's helpers

        return pallas_attention(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, q_tile=q_tile, k_tile=k_tile)
    if impl == "splash":
        from ._splash_attention import splash_attention

        kernel = lambda q, k, v, meta, _: splash_attention(q, k, v, meta, q_tile=q_tile, k_tile=k_tile)  # noqa: E731
        return on_mesh(kernel, "splash", q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta)
    fn = blocked_attention if impl == "blocked" else sharded_attention
    return fn(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE, q_meta, k_meta, q_tile=q_tile, k_tile=k_tile)
