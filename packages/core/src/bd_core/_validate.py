"""Shared checks for the contracts: every failure names the field and what was expected."""

from __future__ import annotations

from typing import Any

import jax
import jax.core  # already loaded by `import jax`; named so that `jax.core.Tracer` resolves statically
import jax.numpy as jnp
import numpy as np


class ContractError(ValueError):
    """A batch, trace or rollout that does not satisfy its contract."""


def is_concrete(*values: Any) -> bool:
    """True when every array's value can be read here, so value checks can run: not a tracer, and
    not a global array with shards on other processes (its shapes and dtypes are still checked)."""
    return not any(isinstance(v, jax.core.Tracer) or (isinstance(v, jax.Array) and not v.is_fully_addressable)
                   for v in jax.tree_util.tree_leaves(values))


def dtype_of(value: Any) -> np.dtype:
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype if dtype is not None else np.asarray(value).dtype)


def as_array(value: Any) -> Any:
    """JAX arrays (and tracers) stay as they are; anything else becomes numpy, so host batches stay
    on the host until the trainer places them."""
    return value if isinstance(value, jax.Array) else np.asarray(value)


def as_int32(value: Any) -> Any:
    """Integer arrays become int32; anything else is left for validation to reject by name."""
    arr = as_array(value)
    return arr.astype(np.int32) if jnp.issubdtype(arr.dtype, jnp.integer) else arr


def check_rank(owner: str, name: str, value: Any, rank: int, dims: str) -> tuple[int, ...]:
    shape = tuple(np.shape(value))
    if len(shape) != rank:
        raise ContractError(f"{owner}.{name}: expected rank {rank} [{dims}], got shape {shape}")
    return shape


def check_shape(owner: str, name: str, value: Any, shape: tuple[int, ...], dims: str) -> None:
    got = tuple(np.shape(value))
    if got != tuple(shape):
        raise ContractError(f"{owner}.{name}: expected shape {tuple(shape)} [{dims}], got {got}")


def check_int(owner: str, name: str, value: Any) -> None:
    dt = dtype_of(value)
    if not jnp.issubdtype(dt, jnp.integer):
        raise ContractError(f"{owner}.{name}: expected an integer dtype, got {dt}")


def check_bool(owner: str, name: str, value: Any) -> None:
    dt = dtype_of(value)
    if dt != np.bool_:
        raise ContractError(f"{owner}.{name}: expected dtype bool, got {dt}")


def check_real_or_bool(owner: str, name: str, value: Any) -> None:
    dt = dtype_of(value)
    if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.floating)):
        raise ContractError(f"{owner}.{name}: expected a floating or bool dtype, got {dt}")


def check_float(owner: str, name: str, value: Any) -> None:
    dt = dtype_of(value)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ContractError(f"{owner}.{name}: expected a floating dtype, got {dt}")


def check_finite_nonneg(owner: str, name: str, value: Any) -> None:
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ContractError(
            f"{owner}.{name}: expected finite values, found {int(np.sum(~np.isfinite(arr)))} non-finite")
    if np.any(arr < 0):
        raise ContractError(f"{owner}.{name}: expected values >= 0, found minimum {arr.min()}")
