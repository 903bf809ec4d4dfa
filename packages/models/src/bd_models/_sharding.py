"""Meshes and partition specs: FSDP over the embedding dim (the vocabulary's for the embedding and
the head where `fsdp` divides it: `vocab_split`), tensor parallel over heads and the MLP hidden
dim, batches over (`data`, `fsdp`); sizes that do not divide their axes fail before compiling.
With several processes, arrays are assembled from each process's host data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bd_core import ConfigError

from ._activations import vocab_split
from ._attention import BATCH_AXES, MODEL_AXIS
from ._config import ModelConfig

AXES = ("data", "fsdp", "model")

# Per parameter name (the last path entry): the axes of its dims after the stacked layer axis.
# The embedding `[V, D]` and the head `[D, V]` split their vocabulary instead where `vocab_split`
# (`_VOCAB_SPECS`; why: `_activations`).
_SPECS = {
    "embedding": ("__none__", "fsdp"),
    "lm_head": ("fsdp", "__none__"),
    "final_norm": ("__none__",),
    "attn_norm": ("__none__",),
    "mlp_norm": ("__none__",),
    "wq": ("fsdp", MODEL_AXIS),
    "wk": ("fsdp", MODEL_AXIS),
    "wv": ("fsdp", MODEL_AXIS),
    "wo": (MODEL_AXIS, "fsdp"),
    "w_gate": ("fsdp", MODEL_AXIS),
    "w_up": ("fsdp", MODEL_AXIS),
    "w_down": (MODEL_AXIS, "fsdp"),
    "q_norm": ("__none__",),
    "k_norm": ("__none__",),
    "bq": (MODEL_AXIS,),
    "bk": (MODEL_AXIS,),
    "bv": (MODEL_AXIS,),
}

_VOCAB_SPECS = {"embedding": ("fsdp", "__none__"), "lm_head": ("__none__", "fsdp")}

# A LoRA-wrapped projection (`LoRAWeight`): the frozen matrix keeps its rule, `lora_a [in, r]`
# splits its input axis like the matrix, `lora_b [r, out]` its output axis; r is never split.
_LORA_PARTS = ("base", "lora_a", "lora_b")


# jax.Device is the jaxlib class re-exported by assignment, and jaxlib ships no stub: pyright sees a variable.
def make_mesh(data: int, fsdp: int, model: int,
              devices: Sequence[jax.Device] | None = None) -> Mesh:  # pyright: ignore[reportInvalidTypeForm]
    """A (`data`, `fsdp`, `model`) mesh with Auto axis types (GSPMD propagates the shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    if data * fsdp * model != len(devices):
        raise ValueError(f"make_mesh: data*fsdp*model = {data}*{fsdp}*{model} = {data * fsdp * model} must equal the "
                         f"number of devices ({len(devices)}); change the axis sizes or pass devices=")
    return jax.make_mesh((data, fsdp, model), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


class MeshError(ConfigError):
    """A batch or model size that does not divide the mesh axes it is sharded over."""


def check_divisibility(config: ModelConfig, mesh: Mesh, batch_size: int | None = None) -> None:
    """Refuse, before anything compiles, a batch, head count or hidden size that does not divide
    the mesh axes it is split over (the batch over the product of all data-parallel axes)."""
    n_batch, fsdp, model = mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["fsdp"], mesh.shape[MODEL_AXIS]
    checks = [("batch size", batch_size, "data*fsdp", n_batch),
              ("n_heads", config.n_heads, "model", model), ("n_kv_heads", config.n_kv_heads, "model", model),
              ("d_ff", config.d_ff, "model", model), ("d_model", config.d_model, "fsdp", fsdp)]
    for name, size, axes, n in checks:
        if size is not None and size % n:
            raise MeshError(f"{name} = {size} does not divide the mesh axes it is sharded over ({axes} = {n}) "
                            f"on the mesh {dict(mesh.shape)}; make {name} a multiple of {n} or change the mesh")


def leaf_name(path) -> str:
    """The last key of a pytree path: a field name, a dict key or an index ("None" at the root)."""
    last = path[-1] if path else None
    return str(getattr(last, "name", getattr(last, "key", last)))


def param_partition_specs(model, mesh: Mesh | None = None):
    """A pytree like `model` with a `PartitionSpec` per array. With `mesh`, a dimension that its
    axis does not divide raises `MeshError` naming the parameter; the embedding and the head split
    their vocabulary over `fsdp` where it divides it (`vocab_split`; without `mesh`, always), and
    never over `model`: on a mesh with `fsdp` = 1 every chip holds them whole."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    by_vocab = vocab is not None and (mesh is None or vocab_split(vocab, mesh.shape["fsdp"]))
    specs = {**_SPECS, **_VOCAB_SPECS} if by_vocab else _SPECS

    def spec(path, leaf):
        name = leaf_name(path)
        if name in _LORA_PARTS and len(path) > 1:  # a LoRA-wrapped projection: split like its matrix
            parent = leaf_name(path[:-1])
            if parent not in specs:
                raise ValueError(f"param_partition_specs: no partition rule for parameter {jax.tree_util.keystr(path)}")
            rule = specs[parent]
            rule = {"base": rule, "lora_a": (rule[0], "__none__"), "lora_b": ("__none__", rule[1])}[name]
        elif name == "dropout_key":
            rule = ()
        elif name in specs:
            rule = specs[name]
        else:
            raise ValueError(f"param_partition_specs: no partition rule for parameter {jax.tree_util.keystr(path)}")
        axes = [None if a == "__none__" else a for a in rule]
        axes = [None] * (np.ndim(leaf) - len(axes)) + axes  # the stacked layer axis is never split
        for dim, axis in enumerate(axes):
            if mesh is not None and axis is not None and np.shape(leaf)[dim] % mesh.shape[axis]:
                raise MeshError(f"parameter {jax.tree_util.keystr(path)}: dimension {dim} of shape "
                                f"{np.shape(leaf)} does not divide the mesh axis {axis} = {mesh.shape[axis]}; "
                                f"change the model size or the mesh")
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, model)


def _place(x, sharding: NamedSharding, global_shape: tuple[int, ...]):
    # One process, or an array already spread over the processes (a rollout sampled on the mesh):
    # a plain transfer. Otherwise every process passes host data and keeps its shards.
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)


def shard_model(model, mesh: Mesh):
    """Place every parameter on `mesh` by `param_partition_specs` (after `check_divisibility`).
    With several processes every process must pass the same model (same key)."""
    if isinstance(getattr(model, "config", None), ModelConfig):
        check_divisibility(model.config, mesh)
    specs = param_partition_specs(model, mesh)
    return jax.tree.map(lambda x, s: _place(x, NamedSharding(mesh, s), np.shape(x)), model, specs)


def init_sharded(make: Callable[[], eqx.Module], mesh: Mesh) -> eqx.Module:
    """Build a model straight into its shards: `make()` (e.g. `lambda: BlockDiffusionLM(config,
    key=key)`) runs under jit with each parameter's output sharding, so no device ever holds the
    whole model. The values are those of `shard_model(make(), mesh)` up to float rounding (jit
    may fuse the initializers' arithmetic: |Δ| ≤ 6e-8 measured), on any number of processes."""
    abstract = eqx.filter_eval_shape(make)
    if isinstance(getattr(abstract, "config", None), ModelConfig):
        check_divisibility(abstract.config, mesh)
    shapes, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(shapes, mesh))
    arrays = jax.jit(lambda: eqx.filter(make(), eqx.is_array), out_shardings=shardings)()
    return eqx.combine(arrays, static)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch's leading axis over the mesh's data axes (`data`, `fsdp`)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def logits_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """Where logits `[B, T, V]` live on `mesh`, as the model computes them: rows over `data` and the
    vocabulary over `fsdp` where `fsdp` divides it (`vocab_split`), else rows over (`data`, `fsdp`)
    like a batch. A batch's teacher logits placed so reach OPD's loss without being resharded."""
    if vocab_split(vocab_size, mesh.shape["fsdp"]):
        return NamedSharding(mesh, P("data", None, "fsdp"))
    return batch_sharding(mesh)


def logits_format(mesh: Mesh, vocab_size: int) -> Format:
    """`logits_sharding` with the row-major layout fixed: how teacher logits that a distillation
    batch carries (`DistillationBatch.teacher_logits`; the OPD stage carries the teacher's features
    instead) are best held from the teacher's forward to the train step, which reads them position
    by position. Left to its
    default, libtpu lays out a `[rows, T, V/fsdp]` shard whose vocabulary slice is not a multiple
    of 128 lanes (151,936 over 8 chips: 18,992) with the rows in the lanes once a chip holds a
    multiple of 128 rows, and the train step then copies the whole argument back to row-major
    before reading it. Where row-major is the default (CPU, GPU, lane-aligned shards) this is the
    default layout and changes nothing."""
    return Format(Layout(major_to_minor=(0, 1, 2)), logits_sharding(mesh, vocab_size))


def shard_batch(batch, mesh: Mesh, *, process_local: bool = False):
    """Place every array of a batch pytree with its leading (batch) axis over (`data`, `fsdp`).

    With several processes, each passes either the same global batch (the default: every process
    reads the same deterministic stream and keeps its rows) or, with `process_local=True`, only
    its own rows (a data pipeline sharded by process), which are concatenated in process order.
    Arrays that already span the processes (computed on the mesh) are resharded as they are.
    """
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    scale = jax.process_count() if process_local else 1

    def put(x):
        if np.ndim(x) == 0:
            return _place(x, NamedSharding(mesh, P()), ())
        spread = isinstance(x, jax.Array) and not x.is_fully_addressable
        shape = (np.shape(x)[0] * (1 if spread else scale), *np.shape(x)[1:])
        if shape[0] % n:
            raise MeshError(f"shard_batch: batch size {shape[0]} does not divide the data-parallel axes "
                            f"data*fsdp = {n}; use a batch size that is a multiple of {n}")
        return _place(x, batch_sharding(mesh), shape)

    return jax.tree.map(put, batch)


def to_host(tree):
    """Every array of `tree` whole, as numpy, on every process: arrays that span processes are
    gathered (a collective: every process must call it), the rest are read locally."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(get, tree)


def zeros_placed_like(x: jax.Array) -> jax.Array:
    """Float32 zeros (+0 exactly) shaped like `x` and, inside a program, placed like it: an
    accumulator for `x`'s gradient. A constant (`jnp.zeros`) has no operand to take a placement from,
    so XLA's partitioner keeps it whole on every device, and an FSDP accumulator would come back
    from each update replicated (the model's size in float32 per device). Derived from `x`
    elementwise (a NaN or infinity of `x` included), it is split as `x` is."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(jnp.isfinite(x), jnp.abs(x * 0.0), jnp.zeros((), jnp.float32))
