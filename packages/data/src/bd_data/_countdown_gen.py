"""reasoning-gym's countdown problems, made without sympy in the per-problem loop: the same entries.

The library draws each candidate expression with sympy (`expr * sym`, `expr.subs(...)`, `str(expr)`),
about 2 ms a problem: a quarter of the default run's CPU went into making SFT batches. A candidate is
a left fold of `+ - * /` over its numbers, so its sympy form depends only on the fold's operators.
`CountdownProblems` keeps the library's `__getitem__` and `_generate_expression` and replaces only
`_generate_candidate_expression`: it makes the same calls on the same `Random` in the same order,
evaluates the fold exactly with `Fraction`s (sympy's values are exact rationals too, and both `int`s
truncate toward zero) and prints each operator sequence with sympy once. Its entries equal the
library's, dict for dict (`packages/data/tests/test_countdown_gen.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from fractions import Fraction
from random import Random
from typing import Any

import sympy
from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


@functools.cache
def _symbols(num_terms: int) -> tuple[sympy.Symbol, ...]:
    return tuple(sympy.symbols(f"x_{0}:{num_terms}"))


@functools.cache
def _names(num_terms: int) -> tuple[str, ...]:
    """The symbols' names, which stand in for them: the library only keys `subs` and calls `str` on them."""
    return tuple(str(sym) for sym in _symbols(num_terms))


@functools.cache
def _printed(ops: tuple[str, ...]) -> str:
    """sympy's text of the fold `x_0 ops[0] x_1 ops[1] ...`, as the library builds and prints it."""
    syms = _symbols(len(ops) + 1)
    expr = syms[0]
    for op, sym in zip(ops, syms[1:]):
        expr = _APPLY[op](expr, sym)
    return str(expr)


@dataclasses.dataclass(frozen=True)
class _Fold:
    """A candidate expression, for the library's `int(expr.subs({symbol: number}))`: its exact value."""

    ops: tuple[str, ...]
    syms: tuple[str, ...]

    def subs(self, values: dict[str, int]) -> Fraction:
        value = Fraction(values[self.syms[0]])
        for op, sym in zip(self.ops, self.syms[1:]):
            value = _APPLY[op](value, values[sym])
        return value


class CountdownProblems(CountdownDataset):
    """reasoning-gym's `CountdownDataset` whose candidates are operator folds instead of sympy
    expressions; `dataset[j]` is the library's entry `j`."""

    def _generate_candidate_expression(self, rng: Random, num_terms: int):  # type: ignore[override]
        # The library's draws, in its order: the numbers, then per operator one choice and, for a
        # division, a shuffle of the candidate divisors.
        numbers = [rng.randint(self.config.min_value, self.config.max_value) for _ in range(num_terms)]
        syms = _names(num_terms)
        ops: list[str] = []
        value = Fraction(numbers[0])
        for i in range(1, num_terms):
            op = rng.choice(self.config.operators)
            if op == "/":
                if numbers[i] != 0:
                    current = int(value)
                    remaining = [n for n in numbers[i:] if n != 0]
                    rng.shuffle(remaining)
                    for div in remaining:
                        if current % div == 0:
                            numbers[i] = div
                            break
                    else:
                        op = "-"  # no number divides evenly: the library subtracts
                else:
                    op = "+"  # the library adds a zero instead of dividing by it
            ops.append(op)
            value = _APPLY[op](value, numbers[i])
        expr_str = _printed(tuple(ops))
        replacements = [(sym, str(numbers[i])) for i, sym in enumerate(syms)]
        replacements.sort(key=lambda x: len(x[0]), reverse=True)
        for sym_name, num_str in replacements:
            expr_str = expr_str.replace(sym_name, num_str)
        return _Fold(tuple(ops), syms), numbers, list(syms), expr_str


def countdown_problems(**config: Any) -> CountdownProblems:
    """`reasoning_gym.create_dataset("countdown", **config)`, with the faster candidates."""
    settings = CountdownConfig(**config)
    settings.validate()
    return CountdownProblems(config=settings)
