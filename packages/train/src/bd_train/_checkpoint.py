"""Orbax checkpoints of a `TrainState` (+ data-iterator state) with fingerprinted JSON metadata.

Restores fail closed: fingerprints, then every saved leaf's shape and dtype are compared with the
target before any array is read, and the error names each differing field or leaf. Every save
records a content digest (SHA-256 of dtype, shape and bytes) of each array; every restore
recomputes them and refuses, naming the array, if the files no longer hold what was saved. A
file that cannot be read (truncated, missing) is one `CheckpointCorrupted` message too.

Digests are per shard and computed where the shard lives (`_shard_digests`), so arrays that span
processes are covered, and a checkpoint written by a group verifies when restored into another
mesh or one process. In a group every refusal is agreed: a shard that one process finds damaged,
or a file that one process cannot read, makes every process raise the same message.

Asynchronous saves (`async_save=True`) return once the arrays are on the host; Orbax writes them
on background threads while training goes on, and the digests are computed there too, from the
host copies taken when the save began. The JSON metadata, digests included, is one of the
items of the same Orbax commit: the step's temp dir is renamed to `<step>` only after every item
is written, so a step is listed and restorable only when it is whole, and a kill mid-save leaves
the previous step. In a group the digests are computed and gathered when the save begins (the
gather is a collective, which must stay in program order on the main thread); only the writes
overlap training there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from bd_core import Fingerprint, FingerprintMismatch
from bd_models import trainable

from ._checkpoint_errors import CheckpointCorrupted as CheckpointCorrupted
from ._checkpoint_errors import CheckpointError as CheckpointError
from ._checkpoint_errors import CheckpointMismatch as CheckpointMismatch
from ._checkpoint_errors import named, plain, quiet_reads_left_behind
from ._checkpoint_meta import PendingMeta, data_state_whole, meta_handler, versions
from ._checkpoint_trees import (
    arrays_of,
    describe,
    fill,
    fill_trained,
    flat,
    flat_items,
    is_key,
    mesh_of,
    nested,
    restore_target,
)
from ._fingerprints import as_plain_dict
from ._shard_digests import (
    agreed_errors,
    damaged_shards,
    digest_host_shards,
    host_shards,
    unreadable_shards,
)

if TYPE_CHECKING:
    from ._trainer import TrainState

ARRAY_ITEMS = ("model", "opt_state", "rng", "counters")
# The barrier every process passes at the end of an Orbax restore (`Checkpointer.restore`, no key
# prefix): a process whose read failed passes it too, so that the group can agree on the failure.
_ORBAX_RESTORE_BARRIER = "Checkpointer:restore"


class Checkpointer:
    """Saves and restores `TrainState`s under `directory/<step>` with an Orbax `CheckpointManager`.

    Items: `model` (its trained arrays: a LoRA model's adapters only), `opt_state`, `rng`,
    `counters` (arrays), `meta` (JSON: fingerprints, versions, config) and, when given, `data` (a
    grain iterator's state). Saves are atomic (Orbax writes a temp dir and renames it); stray temp
    dirs are ignored.

    With `async_save=True`, `save` returns once the arrays are on the host and the step is
    written and digested in the background; it is listed (`all_steps`, `latest_step`) only once
    it is committed. The next `save`, `wait` and `close` wait for it, and raise `CheckpointError`
    if it failed.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = False,
                 create: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.isfile(self.directory):
            raise CheckpointError(f"{self.directory} is a file; a checkpoint is a folder of step folders")
        if not create and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist; check the path, or pass "
                                  "create=True to start a new one")
        handlers: dict[str, Any] = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
        handlers["meta"] = meta_handler()
        handlers["data"] = grain.checkpoint.CheckpointHandler()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._async = async_save
        self._in_flight: int | None = None  # the step of an asynchronous save not yet known to be committed

    # -- queries -------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps: a step still being written in the background is not one (Orbax
        lists it from the moment its save begins; it is committed once renamed from its temp dir)."""
        steps = sorted(self._manager.all_steps())
        step = self._in_flight
        if step is not None and step in steps and not os.path.isdir(os.path.join(self.directory, str(step))):
            steps.remove(step)
        return steps

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            inside = sorted(entry.name for entry in os.scandir(self.directory) if entry.is_dir()
                            and any(name.isdigit() for name in os.listdir(entry.path)))
            if inside:  # the folder above a run's stage checkpoints
                raise CheckpointError(f"no checkpoint in {self.directory}, but its folders {inside} hold some; give "
                                      f"one of them (e.g. {os.path.join(self.directory, inside[-1])!r})")
            raise CheckpointError(f"no checkpoint in {self.directory}; point to the folder a previous run saved a "
                                  "stage into (<output_dir>/pipeline/<run>/checkpoints/<stage>)")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available steps: {steps}")
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with `step` (the latest by default): fingerprints, history, config."""
        step = self._resolve(step)
        return dict(self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()), "its metadata")["meta"])

    def _read(self, step: int, args: Any, what: str, paths: Sequence[str] = (),
              saved: Mapping[str, Any] | None = None) -> Any:
        """`manager.restore`, with an unreadable file turned into one message that says how to
        recover, naming each shard of `paths` (leaf paths, `saved` their digests) that cannot be
        read; in a group, every process raises it when any process could not read."""
        restored, error = None, None
        quiet_reads_left_behind()  # before: a failed read may report while the restore still runs
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as err:  # noqa: BLE001  (tensorstore/orbax raise many kinds for a damaged file)
            unreadable = unreadable_shards(os.path.join(self.directory, str(step)), paths, saved) if paths else []
            if unreadable:
                error = f"the content of {named(unreadable)} could not be read"
            else:
                first = (str(err).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
                error = f"{what} could not be read ({type(err).__name__}: {plain(first)[:300]})"
            if jax.process_count() > 1:  # the others wait in Orbax's barrier at the end of a restore
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(_ORBAX_RESTORE_BARRIER)
        errors = agreed_errors(error)
        if errors:
            where = "" if jax.process_count() == 1 else f" on process {min(errors)}"
            corrupted = CheckpointCorrupted(
                f"checkpoint {self.directory} step {step}: {errors[min(errors)]}{where}; its files are truncated, "
                f"missing or damaged. {self._recovery(step)}")
            corrupted.cause = errors[min(errors)] + where
            raise corrupted from None
        return restored

    def _recovery(self, step: int) -> str:
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            return (f"Restore an earlier step ({earlier}) after removing {os.path.join(self.directory, str(step))}, "
                    "or rerun the stage")
        return (f"No earlier step is kept: remove {os.path.join(self.directory, str(step))} (or the whole "
                f"{self.directory}) and rerun the stage that wrote it")

    def _verify(self, restored: Mapping[str, Any], step: int, meta: Mapping[str, Any]) -> None:
        """Refuse restored arrays whose content digest differs from the one recorded at save."""
        saved = meta.get("digests")
        if saved is None:
            raise CheckpointCorrupted(f"checkpoint {self.directory} step {step} records no content digests (it was "
                                      f"written by an older bdlm), so its content cannot be verified; rerun the "
                                      "stage that wrote it")
        damaged = damaged_shards(flat_items(restored), saved)
        if damaged:
            raise CheckpointCorrupted(f"checkpoint {self.directory} step {step}: the content of {named(damaged)} "
                                      f"differs from what was saved; the files are corrupted. {self._recovery(step)}")

    def fingerprints(self, step: int | None = None) -> dict[str, Fingerprint]:
        """The fingerprints saved with `step` (the latest by default), by name."""
        return {name: Fingerprint.from_json(record) for name, record in self.read_meta(step)["fingerprints"].items()}

    # -- save ----------------------------------------------------------------------------------------

    def save(self, state: TrainState, *, fingerprints: Mapping[str, Fingerprint] | None = None,
             config: Any = None, data_iterator: Any = None, force: bool = False,
             history: list[dict[str, Any]] | None = None, overrides: list[dict[str, Any]] | None = None,
             extra: Mapping[str, Any] | None = None) -> int:
        """Save `state` at its step; returns the step. `config` (a mapping or dataclass), the
        metric `history` so far (JSON-ready rows), the deliberate fingerprint `overrides`
        accepted on earlier resumes and `extra` (JSON-ready values a caller keeps with the step:
        the stages' OPD guard keeps its comparisons there) are stored whole in the JSON metadata."""
        if state.accumulator is not None and int(state.accumulator.count) != 0:
            raise CheckpointError("save: the state holds a partly accumulated update; save after a call with "
                                  "is_update_step=True")
        self.wait()  # the previous save first: its error, if any, is raised here and not lost
        step = int(state.step)
        arrays = arrays_of(state)
        shards = host_shards(flat_items(arrays))  # host copies of this save's values, before training goes on
        deferred = self._async and jax.process_count() == 1
        meta: dict[str, Any] = {
            "step": step,
            "fingerprints": {name: fp.to_json() for name, fp in (fingerprints or {}).items()},
            "versions": versions(),
            "config": None if config is None else as_plain_dict(config, "save(config=...)"),
            "has_data_state": data_iterator is not None,
            "digests": None if deferred else digest_host_shards(shards),
            "history": history,
            "overrides": overrides or [],
            "extra": dict(extra or {}),
        }
        try:  # a copy, as JSON: the caller's lists (the history) grow while an asynchronous save writes
            meta = json.loads(json.dumps(meta))
        except TypeError as err:
            raise CheckpointError(f"save: the metadata (config, history, overrides or extra) is not JSON "
                                  f"({err})") from None
        # Orbax refuses empty trees (e.g. plain SGD's optimizer state): such items are left out.
        items: dict[str, Any] = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items() if tree}
        # a PendingMeta becomes the mapping inside the commit (`meta_handler`)
        pending: Any = PendingMeta(meta, functools.partial(digest_host_shards, shards)) if deferred else meta
        items["meta"] = ocp.args.JsonSave(pending)
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        self._in_flight = step if self._async else None
        return step

    def wait(self) -> None:
        """Block until the save in flight, if any, is committed; raise `CheckpointError` if it
        failed (the step is then not listed, and earlier steps are kept)."""
        step, self._in_flight = self._in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001  (whatever the background writer raised)
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(
                f"checkpoint {self.directory}: the asynchronous save of step {step} failed in the background "
                f"({type(err).__name__}: {first}); it was not committed, and the latest complete step is "
                f"{self.latest_step()}. Check the disk (space, permissions) and continue from that step") from err

    def close(self) -> None:
        """Wait for pending saves, then close the manager."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore -------------------------------------------------------------------------------------

    def check_fingerprints(self, current: Mapping[str, Fingerprint], step: int | None = None, *,
                           allow: Sequence[str] = ()) -> dict[str, tuple[Any, Any]]:
        """Raise `FingerprintMismatch` naming every differing `<fingerprint>.<field>`, except
        those `allow` names (a field, or a table such as `training.grpo.optim` for every field in
        it): those deliberate changes are returned, (saved, current) per field, for the caller to
        record."""
        step = self._resolve(step)
        saved = self.fingerprints(step)
        differences: dict[str, tuple[Any, Any]] = {}
        for name, fp in current.items():
            if name not in saved:
                differences[name] = ("<not recorded>", fp.digest[:12])
                continue
            differences.update({f"{name}.{field}": pair for field, pair in saved[name].diff(fp).items()})
        allowed = {k: v for k, v in differences.items() if any(k == a or k.startswith(a + ".") for a in allow)}
        refused = {k: v for k, v in differences.items() if k not in allowed}
        if refused:
            raise FingerprintMismatch(refused, f"checkpoint {self.directory} step {step}")
        return allowed

    def check_tree(self, target: TrainState, step: int | None = None) -> None:
        """Raise `CheckpointMismatch` naming every leaf whose shape or dtype differs, or that
        exists on one side only."""
        step = self._resolve(step)
        self._check_items(arrays_of(target), step, self.read_meta(step))

    def _check_items(self, items: Mapping[str, Any], step: int, meta: Mapping[str, Any]) -> None:
        quiet_reads_left_behind()
        try:
            metadata = self._manager.item_metadata(step)
        except Exception as err:  # noqa: BLE001  (a damaged metadata file)
            raise CheckpointCorrupted(f"checkpoint {self.directory} step {step}: its array metadata could not be read "
                                      f"({type(err).__name__}). {self._recovery(step)}") from None
        differences = {}
        recorded = meta.get("digests") or {}  # every array the step was saved with, by path
        for name, tree in items.items():
            item = metadata.get(name) if hasattr(metadata, "get") else metadata[name]
            if item is None and name in ("rng", "counters"):
                raise CheckpointError(f"checkpoint {self.directory} step {step} has no {name!r} item; it is "
                                      "incomplete or was not written by bd_train")
            if item is None and any(path.startswith(f"{name}/") for path in recorded):  # saved, now unreadable
                raise CheckpointCorrupted(
                    f"checkpoint {self.directory} step {step}: its {name!r} arrays were saved but their files "
                    f"({os.path.join(self.directory, str(step), name)}) are missing or damaged. "
                    f"{self._recovery(step)}")
            saved = {} if item is None else flat(item.tree, name)
            wanted = flat(tree, name)
            for path in sorted(set(saved) | set(wanted)):
                if path not in wanted:
                    differences[path] = (describe(saved[path].shape, saved[path].dtype), "<absent>")
                elif path not in saved:
                    differences[path] = ("<absent>", describe(np.shape(wanted[path]), wanted[path].dtype))
                else:
                    a, b = saved[path], wanted[path]
                    if tuple(a.shape) != tuple(np.shape(b)) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
                        differences[path] = (describe(a.shape, a.dtype), describe(np.shape(b), b.dtype))
        if differences:
            raise CheckpointMismatch(differences, f"checkpoint {self.directory} step {step}")

    def restore_model(self, target: Any, *, step: int | None = None,
                      fingerprints: Mapping[str, Fingerprint] | None = None) -> Any:
        """Only the model of a saved state, restored into the structure, shardings and dtypes of
        `target` (a model, or its `eqx.filter_eval_shape` with shardings), after checking
        `fingerprints` and the model's leaves; the optimizer state is not read. For a LoRA
        checkpoint `target` is the base with adapters (`add_lora`): the adapters are read, the
        base is kept."""
        step = self._resolve(step)
        self.check_fingerprints(fingerprints or {}, step)
        arrays = nested(trainable(target))
        meta = self.read_meta(step)
        self._check_items({"model": arrays}, step, meta)
        mesh = mesh_of(arrays)
        abstract = jax.tree_util.tree_map(lambda x: restore_target(x, mesh), arrays)
        restored = self._read(step, ocp.args.Composite(model=ocp.args.StandardRestore(abstract)), "the model",
                              list(flat_items({"model": arrays})), meta.get("digests"))
        self._verify({"model": restored["model"]}, step, meta)
        return fill_trained(target, restored["model"])

    def restore(self, target: TrainState, *, step: int | None = None,
                fingerprints: Mapping[str, Fingerprint] | None = None, data_iterator: Any = None,
                allow: Sequence[str] = ()) -> TrainState:
        """Restore into the structure, shardings and dtypes of `target` (a fresh state, or one of
        `jax.ShapeDtypeStruct`s from `eqx.filter_eval_shape`), after checking `fingerprints`
        (but the fields `allow` names) and the tree. `data_iterator`, if given, is set to the
        saved position in place."""
        step = self._resolve(step)
        self.check_fingerprints(fingerprints or {}, step, allow=allow)
        meta = self.read_meta(step)
        self._check_items(arrays_of(target), step, meta)
        if data_iterator is not None and not meta.get("has_data_state"):
            raise CheckpointError(f"checkpoint {self.directory} step {step} holds no data-iterator state; restore "
                                  "without data_iterator= and position the data yourself")
        arrays = arrays_of(target)
        mesh = mesh_of(arrays)
        items: dict[str, Any] = {
            name: ocp.args.StandardRestore(jax.tree_util.tree_map(lambda x: restore_target(x, mesh), tree))
            for name, tree in arrays.items() if tree}
        paths = list(flat_items({name: tree for name, tree in arrays.items() if tree}))
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            restored = self._read(step, ocp.args.Composite(**items), "the saved state", paths, meta.get("digests"))
        except CheckpointCorrupted as err:
            if data_iterator is None or not data_state_whole(os.path.join(self.directory, str(step), "data")):
                raise
            # Read fine without the data pipeline's position: the files are whole, and the saved
            # position does not fit the pipeline given (another pipeline, or one built otherwise).
            items.pop("data")
            self._read(step, ocp.args.Composite(**items), "the saved state", paths, meta.get("digests"))
            raise CheckpointError(
                f"checkpoint {self.directory} step {step}: its arrays read fine, but the data pipeline's saved "
                f"position could not be set on the pipeline given ({err.cause}): the pipeline is not built as the one "
                f"that was saved (another task, data file, batch size or pipeline settings). Nothing was changed: "
                f"rebuild the pipeline as it was, or train anew") from None
        self._verify({name: restored[name] for name in arrays if arrays[name]}, step, meta)
        key = restored["rng"]["key"]
        if is_key(target.key):
            key = jax.random.wrap_key_data(key, impl=jax.random.key_impl(target.key))
        counters = restored["counters"]
        return dataclasses.replace(
            target,
            step=counters["step"],
            model=fill_trained(target.model, restored.get("model") or {}),
            opt_state=fill(target.opt_state, restored.get("opt_state") or {}),
            key=key,
            nonfinite_total=counters["nonfinite_total"],
            nonfinite_streak=counters["nonfinite_streak"],
        )

