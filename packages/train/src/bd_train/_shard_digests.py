"""Content digests of checkpoint arrays, one per saved shard, computed where the shard lives.

A shard is a region of a global array (its index: a slice per axis), digested as SHA-256 of its
dtype, shape and bytes. At save, every process digests the shards whose primary copy it holds
(`replica_id == 0`, on a thread per core), and the digests, 32 bytes each, are gathered so that the primary process
can record them all: the array data never leaves its host. At restore, every saved shard is
checked by one process that holds its region whole in the restored layout (whatever the mesh:
the same one, another, or one process); a region that no process holds whole is brought together
by one collective the size of that shard. The processes then agree on the damaged shards, so
every one of them refuses the checkpoint with the same message.

An array that is not a sharded global array (a NumPy value, a counter on one device) is one
shard, the whole array; in a group, process 0's copy is the one recorded and every process checks
its own. A restore that cannot read its files at all is diagnosed here too (`unreadable_shards`),
so that a truncated file is named by array and shard in the same words as a digest mismatch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

Region = tuple[tuple[int, int], ...]  # (start, stop) per axis


def region_key(region: Region) -> str:
    """`"0:64,0:32"` (an empty string for a scalar): how a shard is named in the metadata."""
    return ",".join(f"{a}:{b}" for a, b in region)


def parse_region(key: str) -> Region:
    return tuple((int(a), int(b)) for a, b in (part.split(":") for part in key.split(","))) if key else ()


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _whole(shape: tuple[int, ...]) -> Region:
    return tuple((0, n) for n in shape)


def digest(value: np.ndarray) -> str:
    value = np.ascontiguousarray(value)
    h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
    h.update(value.reshape(-1).view(np.uint8).data)  # the bytes in place (`tobytes` would copy them)
    return h.hexdigest()


def _threads() -> int:
    """Digests run on a thread per core (hashlib releases the GIL on large buffers)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _is_global(x: Any) -> bool:
    """A `jax.Array` whose shards are recorded one by one: any array in one process; in a group,
    one that spans processes (a process-local copy is one shard, recorded from process 0)."""
    return isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable)


def _size(region: Region) -> int:
    return int(np.prod([b - a for a, b in region], dtype=np.int64))


def _intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


# -- save -------------------------------------------------------------------------------------------

def _owned(x: Any) -> Iterator[tuple[Region, np.ndarray]]:
    """The shards whose recorded digest this process computes, with their data."""
    if _is_global(x):
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                yield _region(shard.index, x.shape), np.asarray(shard.data)
    elif jax.process_index() == 0:
        yield _whole(np.shape(x)), np.asarray(x)


def _all_regions(x: Any) -> list[Region]:
    """Every distinct shard region of `x`, in the same order on every process."""
    if not _is_global(x):
        return [_whole(np.shape(x))]
    return sorted({_region(index, x.shape) for index in x.sharding.devices_indices_map(x.shape).values()})


@dataclasses.dataclass
class HostShards:
    """The shards of a save whose digests this process computes, read to the host when the save
    began (`host_shards`): digesting them later, on another thread while training goes on, sees
    the values of the save whatever happens to the arrays since (an update that donates them)."""

    entries: list[tuple[str, Region]]  # every shard of every leaf, in the same order on every process
    owned: list[tuple[tuple[str, Region], np.ndarray]]


def host_shards(leaves: Mapping[str, Any]) -> HostShards:
    """The host copies (`HostShards`) of the shards of `leaves` (`{path: array}`) whose recorded
    digest this process computes, read on the calling thread (see `_host_shards`). Every
    device-to-host copy is started first, so that they overlap."""
    for x in leaves.values():
        if _is_global(x):
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    shard.data.copy_to_host_async()
    entries = [(path, region) for path, x in leaves.items() for region in _all_regions(x)]
    owned = [((path, region), data) for path, x in leaves.items() for region, data in _owned(x)]
    return HostShards(entries, owned)


def digest_host_shards(shards: HostShards) -> dict[str, dict[str, str]]:
    """`{path: {region key: digest}}` for every shard in `shards`: what a checkpoint records. In a
    group every process must call it, in the same order, on the thread that issues the group's
    other collectives (it gathers the digests with one)."""
    position = {entry: i for i, entry in enumerate(shards.entries)}
    table = np.zeros((len(shards.entries), 32), np.uint8)
    with ThreadPoolExecutor(_threads()) as pool:
        for (entry, _), value in zip(shards.owned, pool.map(lambda item: digest(item[1]), shards.owned)):
            table[position[entry]] = np.frombuffer(bytes.fromhex(value), np.uint8)
    if jax.process_count() > 1:  # each entry is filled by exactly one process
        table = np.bitwise_or.reduce(_allgather(table), axis=0)
    out: dict[str, dict[str, str]] = {}
    for (path, region), row in zip(shards.entries, table):
        out.setdefault(path, {})[region_key(region)] = row.tobytes().hex()
    return out


def shard_digests(leaves: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """`{path: {region key: digest}}` for every shard of every leaf of `leaves` (`{path: array}`),
    on every process: what a checkpoint records. In a group
    every process must call it, with the same paths."""
    return digest_host_shards(host_shards(leaves))


# -- restore ----------------------------------------------------------------------------------------

def _regions_by_process(x: Any) -> dict[int, set[Region]]:
    """The shard regions of the restored `x` each process's devices hold."""
    if not _is_global(x):
        return {jax.process_index(): {_whole(np.shape(x))}}
    out: dict[int, set[Region]] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        out.setdefault(device.process_index, set()).add(_region(index, x.shape))
    return out


def _holders(by_process: Mapping[int, set[Region]], region: Region) -> list[int]:
    """The processes whose shards (`_regions_by_process`) hold `region` whole."""
    total = _size(region)
    return sorted(p for p, regions in by_process.items()
                  if sum(_size(r) for r in (_intersect(region, s) for s in regions) if r is not None) == total)


def _host_shards(x: Any) -> list[tuple[Region, np.ndarray]]:
    """This process's shards of `x` on the host, one per distinct region, read on the calling
    thread. jaxlib's device-to-host read of one buffer is not safe from several threads at once:
    when two threads read the same shard, one can be handed its bytes before the copy has landed
    (about one restore in 300 refused a clean shard that way), so only hashing runs on the pool."""
    if not _is_global(x):
        return [(_whole(np.shape(x)), np.asarray(x))]
    out: dict[Region, np.ndarray] = {}
    for shard in x.addressable_shards:
        own = _region(shard.index, x.shape)
        if own not in out:
            out[own] = np.asarray(shard.data)
    return list(out.items())


def _assemble(shards: list[tuple[Region, np.ndarray]], region: Region) -> np.ndarray:
    """`region` from host `shards` (`_host_shards`) that hold it whole."""
    out = np.empty([b - a for a, b in region], shards[0][1].dtype)
    for own, data in shards:
        part = _intersect(region, own)
        if part is not None:
            out[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(part, region))] = \
                data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(part, own))]
    return out


def _gathered(x: jax.Array, region: Region) -> np.ndarray:
    """`region` of `x`, replicated to every process by one collective (its size, not the array's)."""
    mesh = getattr(x.sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"cannot gather a region of an array sharded by {type(x.sharding).__name__}")
    index = tuple(slice(a, b) for a, b in region)
    out = jax.jit(lambda a: a[index], out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(x)
    return np.asarray(out.addressable_data(0))


def damaged_shards(leaves: Mapping[str, Any], saved: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The `(path, region key)` of every saved shard whose restored content differs from its
    digest: the same list on every process. `saved` is the metadata's digests (a plain digest is
    a whole-array one, as older checkpoints recorded)."""
    entries: list[tuple[str, str, str]] = []
    for path in leaves:
        recorded = saved.get(path)
        if recorded is None:
            continue
        if isinstance(recorded, str):
            recorded = {region_key(_whole(np.shape(leaves[path]))): recorded}
        entries.extend((path, key, value) for key, value in sorted(recorded.items()))
    me = jax.process_index()
    bad = np.zeros(len(entries), np.uint8)
    mine: list[tuple[int, Any, Region, str]] = []
    layouts = {path: _regions_by_process(leaves[path]) for path in {path for path, _, _ in entries}}
    for i, (path, key, want) in enumerate(entries):
        x, region = leaves[path], parse_region(key)
        holders = _holders(layouts[path], region)
        if holders:  # the one that checks it: spread over the holders by the shard's name
            if holders[zlib.crc32(f"{path}/{key}".encode()) % len(holders)] == me:
                mine.append((i, x, region, want))
        else:  # a collective: every process, in the same order
            value = _gathered(x, region)
            bad[i] = me == 0 and digest(value) != want
    host: dict[int, list[tuple[Region, np.ndarray]]] = {}
    for _, x, _, _ in mine:
        if id(x) not in host:
            host[id(x)] = _host_shards(x)

    def check(item: tuple[int, Any, Region, str]) -> bool:
        _, x, region, want = item
        return digest(_assemble(host[id(x)], region)) == want

    with ThreadPoolExecutor(_threads()) as pool:
        for (i, *_), ok in zip(mine, pool.map(check, mine)):
            bad[i] = not ok
    if jax.process_count() > 1:
        bad = np.bitwise_or.reduce(_allgather(bad), axis=0)
    return [(path, key) for (path, key, _), flag in zip(entries, bad) if flag]


# -- unreadable shards ---------------------------------------------------------------------------------
# When Orbax cannot restore an item (a data file truncated or missing), its error names only an
# index of the restore target, not the array. After such a failure, the raw stored value of every
# chunk of the item's arrays is read through TensorStore's OCDBT key-value store (the layout Orbax
# writes: one zarr array per leaf, `a.b.c/<i.j>` chunk keys; no decompression, no device), and each
# saved shard that holds a chunk whose bytes cannot be read is named as the digest check names it.

def _kvstore(item_dir: str):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(item_dir)}/"}).result()


def _chunks(shape: list[int], chunks: list[int]) -> Iterable[tuple[str, Region]]:
    """Every chunk's key and region of a zarr (v2) array."""
    if not shape:
        yield "0", ()
        return
    grid = [math.ceil(n / c) if n else 0 for n, c in zip(shape, chunks)]
    for index in itertools.product(*(range(g) for g in grid)):
        region = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunks, shape))
        yield ".".join(map(str, index)), region


def unreadable_shards(step_dir: str, paths: Iterable[str],
                      saved: Mapping[str, Mapping[str, str] | str] | None = None) -> list[tuple[str, str]]:
    """`(path, region key)` of every shard of the leaves `paths` (`item/a/b`) under `step_dir` whose
    stored bytes cannot be read: the saved shards (region keys of `saved`, the metadata's digests)
    that hold such a chunk, or the chunk's own region where nothing was recorded."""
    by_item: dict[str, list[str]] = {}
    for path in paths:
        item, _, rest = path.partition("/")
        by_item.setdefault(item, []).append(rest)
    out: list[tuple[str, str]] = []
    for item, names in by_item.items():
        try:
            store = _kvstore(os.path.join(step_dir, item))
        except Exception:  # noqa: BLE001  (its manifest is gone: every leaf of the item is unreadable)
            out.extend((f"{item}/{name}", "") for name in names)
            continue
        for name in names:
            path = f"{item}/{name}"
            key = name.replace("/", ".")
            recorded = (saved or {}).get(path)
            shards = [parse_region(k) for k in sorted(recorded)] if isinstance(recorded, Mapping) else []
            try:
                spec = json.loads(store.read(f"{key}/.zarray").result().value)
            except Exception:  # noqa: BLE001
                out.append((path, region_key(shards[0]) if len(shards) == 1 else ""))
                continue
            bad: set[Region] = set()
            for chunk, region in _chunks(list(spec["shape"]), list(spec["chunks"])):
                try:
                    store.read(f"{key}/{chunk}").result()
                except Exception:  # noqa: BLE001  (a value past the end of its file, a missing file)
                    hit = [s for s in shards if _intersect(s, region) is not None] if region else shards
                    bad.update(hit or [region])
            out.extend((path, region_key(region)) for region in sorted(bad))
    return out


# -- agreement ----------------------------------------------------------------------------------------

_MESSAGE_BYTES = 512


def _allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def agreed_errors(message: str | None) -> dict[int, str]:
    """Every process's error message (None: no error), shared with every process: `{process: message}`."""
    if jax.process_count() == 1:
        return {} if message is None else {0: message}
    buffer = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
    if message is not None:
        raw = message.encode()[:_MESSAGE_BYTES]
        buffer[0] = 1
        buffer[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    rows = _allgather(buffer)
    return {p: bytes(row[1:]).rstrip(b"\0").decode(errors="replace") for p, row in enumerate(rows) if row[0]}
