"""Which saved shards a checkpoint can no longer read, named as the digest check names them.

When Orbax cannot restore an item (a data file truncated or missing), its error names only an
index of the restore target (`slice(0, 1, 1), ...`), not the array. This module reads the raw
stored value of every chunk of the item's arrays through TensorStore's OCDBT key-value store (the
layout Orbax writes: one zarr array per leaf, `a.b.c/<i.j>` chunk keys; no decompression, no
device), and names each saved shard (a region key of the metadata's digests) that holds a chunk
whose bytes cannot be read. It runs only after a read has failed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping

from ._shard_digests import Region, _intersect, parse_region, region_key


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
