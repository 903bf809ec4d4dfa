"""Writes the math example's `train.jsonl` and `eval.jsonl` (one `{"prompt", "answer"}` per line):

    python examples/math/make_math.py [--out DIR]

Short arithmetic problems (sums, differences, quotients, fraction sums and differences, percents)
drawn without replacement from a seeded stream, a quarter of each kind held out for eval, so the
files share no prompt. Train answers are plain (`-7`, `3/4`); eval writes every non-integer answer
in an equivalent form (`\\frac{3}{4}`, `0.75`, `-\\frac{1}{6}`) that exact match would miss and
math-verify accepts. Stdlib only; rerunning writes byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

SEED = 0
HERE = Path(__file__).resolve().parent
EVAL_SHARE = 4  # one problem in EVAL_SHARE of each kind is held out
PROPER = sorted({Fraction(n, d) for d in range(2, 7) for n in range(1, d)})  # 1/2 once, not as 2/4 too


def _pools() -> dict[str, list[tuple[str, Fraction]]]:
    """Every problem of each kind, as (prompt, exact value), in a fixed order."""
    small = range(20)
    return {
        "sum": [(f"{a}+{b}=", Fraction(a + b)) for a in small for b in small],
        "difference": [(f"{a}-{b}=", Fraction(a - b)) for a in small for b in small],
        "quotient": [(f"{a}/{b}=", Fraction(a, b)) for a in range(1, 25) for b in range(2, 10)],
        "fraction sum": [(f"{_raw(x)}+{_raw(y)}=", x + y) for x in PROPER for y in PROPER],
        "fraction difference": [(f"{_raw(x)}-{_raw(y)}=", x - y) for x in PROPER for y in PROPER],
        "percent": [(f"{p}% of {m}=", Fraction(p * m, 100)) for p in (10, 20, 25, 50, 75) for m in range(1, 41)],
    }


# How many problems of each kind the two files hold together (eval takes 1 in EVAL_SHARE of them).
COUNTS = {"sum": 200, "difference": 200, "quotient": 120, "fraction sum": 80, "fraction difference": 80,
          "percent": 120}


def _raw(x: Fraction) -> str:
    return f"{x.numerator}/{x.denominator}"


def plain(value: Fraction) -> str:
    """The training form: `-7`, `3/4`, `-19/30`."""
    return str(value.numerator) if value.denominator == 1 else _raw(value)


def _terminates(value: Fraction) -> bool:
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _decimal(value: Fraction) -> str:
    """The exact decimal of a terminating fraction (`-0.35`), without float rounding."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    places = next(k for k in range(1, 20) if (value * 10**k).denominator == 1)
    digits = str(int(value * 10**places)).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def equivalent(value: Fraction, index: int) -> str:
    """The eval form: integers plain; other values as a decimal (terminating ones, every other
    time) or a LaTeX fraction with the sign in front."""
    if value.denominator == 1:
        return plain(value)
    if _terminates(value) and index % 2 == 0:
        return _decimal(value)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def problems(seed: int = SEED) -> dict[str, list[tuple[str, Fraction]]]:
    """The problems of each split, (prompt, value), kinds interleaved in a seeded order."""
    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, Fraction]]] = {"train": [], "eval": []}
    for kind, pool in _pools().items():
        drawn = rng.sample(pool, COUNTS[kind])
        held = len(drawn) // EVAL_SHARE
        splits["eval"] += drawn[:held]
        splits["train"] += drawn[held:]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def records(seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    """The JSONL records of each split: train answers plain, eval answers in an equivalent form."""
    splits = problems(seed)
    return {"train": [{"prompt": p, "answer": plain(v)} for p, v in splits["train"]],
            "eval": [{"prompt": p, "answer": equivalent(v, i)} for i, (p, v) in enumerate(splits["eval"])]}


def write(out: Path, seed: int = SEED) -> dict[str, Path]:
    """Write `train.jsonl` and `eval.jsonl` under `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in records(seed).items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_bytes("".join(json.dumps(row) + "\n" for row in rows).encode())
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=HERE, help="the folder to write into (default: this one)")
    args = parser.parse_args()
    for split, path in write(args.out).items():
        print(f"{path}: {len(path.read_bytes().splitlines())} {split} problems, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
