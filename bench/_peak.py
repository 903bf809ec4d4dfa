"""The float32 matmul peak an MFU divides by, measured beside the work it normalizes.

The 2-core VMs these benchmarks run on change speed within a minute: one 2048² product ran at 250
to 450 GFLOP/s inside one `make bench`. A peak measured once, seconds before the work it divides,
folds that drift into the ratio, in either direction. `interleaved` times, per round, the best of
a few 2048² products and then one call of the work, so that each call is divided by the peak of
the moment it ran in; the median over rounds is the ratio a benchmark reports.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

N = 2048


@dataclass(frozen=True)
class Interleaved:
    """Per round: the work's seconds and the matmul peak (FLOP/s) measured just before it."""

    flops: float
    seconds: tuple[float, ...]
    peaks: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """The median over rounds of (the work's FLOP/s / the peak beside it): the headline."""
        return statistics.median(self.flops / s / p for s, p in zip(self.seconds, self.peaks, strict=True))

    @property
    def best_ratio(self) -> float:
        """The fastest call over the highest peak of the whole run."""
        return self.flops / min(self.seconds) / max(self.peaks)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@functools.cache
def matmul_timer(n: int = N, dtype=jnp.float32) -> Callable[[], float]:
    """Seconds of one `n`³ product of `dtype` operands accumulated in float32 (by default the 2048²
    float32 one), compiled on the first call (a benchmark that counts compiles calls this before it
    starts counting)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(lambda a, b: (jnp.dot(a, b, preferred_element_type=jnp.float32), b))
    jax.block_until_ready(mm(a, b))

    def once() -> float:
        start = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        return time.perf_counter() - start

    return once


def matmul_peak(runs: int = 10) -> tuple[float, float]:
    """Float32 FLOP/s of a 2048² product over `runs` runs measured now: (best, median). For rates of
    parts measured right after it (the profile); a ratio over many seconds takes `interleaved`."""
    rates = [2 * N**3 / matmul_timer()() for _ in range(runs)]
    return max(rates), statistics.median(rates)


def interleaved(call: Callable[[], object], flops: float, rounds: int, *, repeats: int = 3) -> Interleaved:
    """`rounds` times: the best of `repeats` 2048² matmuls, then `call()` timed. `call` must block
    until its work is done (`jax.block_until_ready`) and be compiled already."""
    matmul = matmul_timer()
    seconds, peaks = [], []
    for _ in range(rounds):
        peaks.append(2 * N**3 / min(matmul() for _ in range(repeats)))
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return Interleaved(flops, tuple(seconds), tuple(peaks))
