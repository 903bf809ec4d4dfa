"""Compiling a plan's programs and reading them: each lowered program compiled once per plan
(`figures`, by its StableHLO), and the cost twins XLA's cost analysis is read from (`Twin`), as it
counts a loop's body once however often the loop runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from bd_models import ModelConfig, model_flops, unroll_layers

COSTED = ("flops", "bytes accessed", "optimal_seconds")  # what a plan reads of XLA's cost analysis


@dataclasses.dataclass(frozen=True)
class Twin:
    """What a program's work is read from, as XLA's cost analysis counts a loop's body once however
    often it runs: the program with its layers unrolled (`lowered` one program), or, with `layers`
    the model's own count, two of its twins of 2 and 3 layers, whose difference is one layer's
    cost: the program's is the 3-layer twin's and `layers - 3` times that difference. (Not 1 and 2:
    with one layer XLA fuses the layer with the model's ends, and the tiny test models' second layer
    costs about 6% fewer FLOPs than their third or sixth.) The work is `times` that (a step's
    microbatches)."""

    lowered: tuple[Any, ...]
    times: int = 1
    layers: int | None = None

    @property
    def extrapolated(self) -> bool:
        """Whether the cost is extrapolated from the 2- and 3-layer twins."""
        return len(self.lowered) == 2


def twin(lower_at: Callable[[int | None], Any], layers: int, *, exact: bool, times: int = 1) -> Twin:
    """The cost twin of the program `lower_at(n)` lowers with `n` decoder layers (None: the model's
    own `layers`), unrolled: whole where `exact` (or the model has no more than 3 layers), else at 2
    and 3 layers. Compiling a twin takes time in proportion to its layers: a minute or more for a
    released model's, seconds for 2 and 3."""
    with unroll_layers():
        if exact or layers <= 3:
            return Twin((lower_at(None),), times)
        return Twin((lower_at(2), lower_at(3)), times, layers)


def cost_of(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled program as one dict (empty where it gives none)."""
    cost = compiled.cost_analysis()
    return (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})


@dataclasses.dataclass(frozen=True)
class Figures:
    """What a plan reads of one compiled program: its memory per chip and XLA's cost, or the TPU
    compiler's refusal."""

    memory: tuple[int, int, int, int, int]  # argument, output, alias, temp, generated code
    cost: dict[str, float]
    refused: str | None = None


# Compiles run on threads (JAX compiles outside the GIL): XLA's TPU compiler keeps about 1.5 of a
# 2-core host's cores busy on one program, so two at once fill them. BDLM_PLAN_THREADS sets how many
# (1: one at a time, the least memory: two of SDAR's programs at once need about 1.5x the peak).
_WORKERS = max(1, int(os.environ.get("BDLM_PLAN_THREADS", "2")))
_POOL = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="plan-compile")
_LOCK = threading.Lock()
_KEYS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # a lowered program's StableHLO digest


def _compile(lowered: Any) -> Figures:
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return Figures((0, 0, 0, 0, 0), {}, str(err))
    m = compiled.memory_analysis()
    return Figures((int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                    int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes)), cost_of(compiled))


def submit(lowered: Any, memo: dict[str, Any] | None) -> concurrent.futures.Future:
    """Start compiling `lowered` (on one of `BDLM_PLAN_THREADS` threads, default 2) unless the same program, known by
    its StableHLO, is compiled or compiling already; its `Figures` come from the future. Without
    `memo` it compiles now, on this thread."""
    if memo is None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(_compile(lowered))
        return done
    key = _KEYS.get(lowered)
    if key is None:  # a program's text is long (every layer, unrolled): hashed once, however often submitted
        key = _KEYS[lowered] = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    with _LOCK:
        if key not in memo or memo[key].cancelled():
            memo[key] = _POOL.submit(_compile, lowered)
        return memo[key]


def figures(lowered: Any, memo: dict[str, Any] | None) -> Figures:
    """Compile `lowered` once per plan: the same program (a stage's held-out decoding, a program a
    remedy leaves unchanged) recurs across stages and retries, and is known by its StableHLO
    (`memo`: one per slice, of the futures `submit` started)."""
    return submit(lowered, memo).result()


def twin_cost(twin: Twin, memo: dict[str, Any] | None) -> dict[str, float]:
    """XLA's cost of one pass of the program `twin` stands for: its unrolled twin's, or extrapolated
    from the 2- and 3-layer twins. Empty where the analysis is; `optimal_seconds` -1 where the cost
    model gives no time for either twin."""
    costs = [figures(lowered, memo).cost for lowered in twin.lowered]
    if len(costs) == 1 or not all(costs):
        return costs[0] if all(costs) else {}
    assert twin.layers is not None
    two, three = costs
    cost = {k: three[k] + (twin.layers - 3) * (three[k] - two[k]) for k in COSTED if k in two and k in three}
    if min(two.get("optimal_seconds", -1.0), three.get("optimal_seconds", -1.0)) <= 0:
        cost["optimal_seconds"] = -1.0
    return cost


def splash_flops(config: ModelConfig, tokens: tuple[int, int], passes: int, chips: int) -> float:
    """FLOPs per chip of `attention="splash"`'s kernels over `tokens` (rows, length), `passes` 1 for
    a forward and 3 for a train step, counted as dense attention over every (query, key) pair: an
    upper bound, as the kernels skip the tiles a row's mask leaves empty. 0 for other attentions,
    whose FLOPs XLA counts itself."""
    if config.attention != "splash":
        return 0.0
    return passes * model_flops(config, tokens)["attention_forward"] / chips
