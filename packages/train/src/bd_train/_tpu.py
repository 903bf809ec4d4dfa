"""TPU slices described without owning them: a topology name ("v5p:2x2x2") becomes JAX device
descriptions through libtpu's ahead-of-time compiler; each chip generation's HBM, bandwidth and
peak bfloat16 rate (the vendor's published figures) and the HBM libtpu lets one program use
(`usable_hbm`, which a plan's verdict compares against) are tabled here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: `hbm` bytes (published), `usable_hbm` (the bytes libtpu's compiler
    lets one program use: what a plan's verdict compares against), `hbm_bandwidth` (bytes/s) and
    `peak_flops` (bfloat16 FLOP/s) per chip; a host holds up to `max_host_chips` chips
    (multi-host slices use hosts of `host_bounds`)."""

    name: str
    hbm: int
    hbm_bandwidth: float
    peak_flops: float
    host_bounds: tuple[int, int, int]
    max_host_chips: int
    usable_hbm: int


GiB = 1 << 30
# Google Cloud's published per-chip figures: v5e 16 GB HBM at 819 GB/s, 197 TFLOP/s bf16; v5p
# 95 GB at 2,765 GB/s, 459 TFLOP/s; v6e (Trillium) 32 GB at 1,640 GB/s, 918 TFLOP/s. v5e/v6e
# single hosts hold up to 8 chips; larger v5e/v6e slices and every v5p slice use 4-chip hosts.
# `usable_hbm` is libtpu's own figure (0.0.42.1, the pinned jax's): its compiler refuses a program
# that needs more with "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required
# for HLO temporaries (600.00G) exceeds available HBM (15.75G)", the total counting arguments,
# outputs and temporaries, in GiB; memory_analysis() does not report it. Read from such a refusal
# on each generation (v5e 15.75G, v5p 95.74G, v6e 31.25G); `refusal_bytes` reads it from any
# refusal, and a plan test checks this table against the compiler's message. v5p's is above its
# published 95 GB figure (the chip carries 96 GiB): the verdict trusts the compiler's.
CHIPS = {
    "v5e": Chip("v5e", 16 * GiB, 819e9, 197e12, (2, 2, 1), 8, int(15.75 * GiB)),
    "v5p": Chip("v5p", 95 * GiB, 2765e9, 459e12, (2, 2, 1), 4, int(95.74 * GiB)),
    "v6e": Chip("v6e", 32 * GiB, 1640e9, 918e12, (2, 2, 1), 8, int(31.25 * GiB)),
}

# JAX's `device_kind` of each generation's chips (a v5e reports "TPU v5 lite").
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e",
                "TPU v6e": "v6e"}


def device_chip(device: Any) -> Chip | None:
    """The plan's figures (`Chip`: HBM, bandwidth, bfloat16 peak) of a JAX device's TPU
    generation, read from its `device_kind`; None for another device (a CPU, a GPU, a TPU
    generation the plan does not know)."""
    name = DEVICE_KINDS.get(getattr(device, "device_kind", ""))
    return None if name is None else CHIPS[name]


_SIZE = re.compile(r"\(([\d.]+)([KMGT])\)")
_SCALE = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def refusal_bytes(message: str) -> tuple[int | None, int | None]:
    """(bytes required, bytes available) named by libtpu's out-of-memory refusal ("... the total
    memory required for HLO temporaries (22.79G) exceeds available HBM (15.75G)"); None for a
    figure the message does not give."""
    sizes = [int(float(n) * _SCALE[unit]) for n, unit in _SIZE.findall(message)]
    return (sizes[0] if sizes else None), (sizes[1] if len(sizes) > 1 else None)


class TopologyError(ValueError):
    """A topology this host cannot describe (an unknown name, or libtpu missing)."""


LIBTPU_HINT = ("bd_train.plan compiles for TPU with libtpu, which is not installed in this environment: run "
               "`make plan-env` (a separate venv .plan/ with jax[tpu]; the training venv stays without it) and "
               "`make plan PRESET=... TOPOLOGY=...`, or `.plan/bin/python -m bd_train.plan ...`")


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@dataclasses.dataclass(frozen=True)
class Topology:
    """`name` (e.g. "v5e:2x2"), its chip, `devices` (JAX device descriptions of every chip of every
    slice), `hosts` per slice and `num_slices`."""

    name: str
    chip: Chip
    devices: tuple[Any, ...]
    hosts: int
    num_slices: int

    @property
    def chips(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return (f"{self.name}{slices}: {self.chips} chips, {self.hosts * self.num_slices} hosts, "
                f"{self.chip.hbm / GiB:.0f} GiB HBM ({self.chip.usable_hbm / GiB:.2f} GiB usable by a program) and "
                f"{self.chip.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip")


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """"v5p:2x2x2" -> (the v5p chip, (2, 2, 2)); refuses other forms by name."""
    generation, _, shape = name.partition(":")
    if generation not in CHIPS or not shape:
        raise TopologyError(f"--topology {name!r}: expected <generation>:<shape> with a generation in "
                            f"{sorted(CHIPS)}, e.g. v5e:2x4, v5p:2x2x2, v6e:4x4")
    try:
        dims = tuple(int(d) for d in shape.split("x"))
    except ValueError:
        raise TopologyError(f"--topology {name!r}: the shape {shape!r} is not of the form AxB or AxBxC") from None
    if not 2 <= len(dims) <= 3 or min(dims) < 1:
        raise TopologyError(f"--topology {name!r}: the shape {shape!r} is not of the form AxB or AxBxC")
    if not _sold(generation, dims):
        raise TopologyError(f"--topology {name!r}: {generation} slices are not made in the shape {shape}; "
                            f"give one of {', '.join(SHAPES[generation])}"
                            + (" (or a larger AxBxC with every side a multiple of 4)" if generation == "v5p" else ""))
    return CHIPS[generation], dims


# The slice shapes Google Cloud makes (its v5e, v5p and v6e pages): 2D tori of 1 to 256 chips for
# v5e and v6e; v5p's 3D shapes up to one 4x4x4 cube, and beyond it any shape whose sides are
# multiples of 4 (whole cubes). libtpu describes other shapes too, which no one can rent.
SHAPES = {
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16",
            "16x16x16", "16x16x24"),
}


def _sold(generation: str, dims: tuple[int, ...]) -> bool:
    shape = "x".join(map(str, dims))
    if shape in SHAPES[generation]:
        return True
    return generation == "v5p" and len(dims) == 3 and all(d % 4 == 0 for d in dims)


def topology(name: str, *, num_slices: int = 1) -> Topology:
    """The devices of `num_slices` slices of topology `name`, as libtpu's compiler sees them."""
    chip, dims = parse_topology(name)
    if not libtpu_available():
        raise TopologyError(LIBTPU_HINT)
    # libtpu reads these at start-up; without them it logs that it cannot find a TPU host.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu holds a machine-wide lock file for the TPU it drives; a plan drives none (it only
    # compiles), so plans may run side by side.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    chips = math.prod(dims)
    bounds = (*dims, 1)[:3] if chips <= chip.max_host_chips and len(dims) == 2 else chip.host_bounds
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=bounds, num_slices=num_slices)
    except Exception as err:  # libtpu's own message names what it could not lay out
        raise TopologyError(f"--topology {name!r}: libtpu cannot describe it: {err}") from None
    devices = tuple(desc.devices)
    hosts = len({d.process_index for d in devices}) // max(1, num_slices) or 1
    return Topology(name, chip, devices, hosts, num_slices)
