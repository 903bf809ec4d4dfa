"""The math-verify worker process, run by path (never imported): `_bounded_verify` owns it.

Reads one JSON `[gold, answer]` per stdin line and writes `1` or `0` per line after `ready`; the
parent kills it when an answer overruns its deadline. Its memory is capped so a blow-up fails here.
"""

import json
import logging
import re
import sys
from functools import lru_cache

MEMORY_LIMIT = 4 << 30  # bytes of address space


def main() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    except (ImportError, ValueError, OSError):  # not every platform enforces or allows it
        pass
    logging.disable(logging.CRITICAL)  # math-verify warns that its own timeouts are off: they are ours
    from math_verify import parse, verify

    def read(text: str, inline: bool) -> list:
        found = parse(f"${text}$" if inline else text, parsing_timeout=None)  # type: ignore[arg-type]
        return found if any(not isinstance(x, str) for x in found) else []  # a string alone: nothing parsed

    def parsed(text: str, bare: bool = False) -> list:
        # An answer without delimiters (`3\sqrt{2}`, `2^{10}`) read as plain text gives only its
        # leading number (3, 2): a bare answer, and text that is LaTeX alone (a backslash, `^` or
        # `{`, and no word of prose outside its commands), is read as inline math first. Other text
        # (prose around a number, `3^2 is 9`) is read as plain text first.
        delimited = "$" in text or "\\boxed" in text
        prose = re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", text)) is not None
        latex = bare or (any(mark in text for mark in ("\\", "^", "{")) and not prose)
        if latex and not delimited:
            return read(text, inline=True) or read(text, inline=False)
        return read(text, inline=False) or read(text, inline=True)

    parsed_gold = lru_cache(maxsize=4096)(lambda gold: parsed(gold, bare=True))
    # One comparison before `ready`: math-verify and sympy import more on first use (the LaTeX and
    # expression parsers), which would otherwise count against the first answer's deadline.
    verify(parsed(r"\frac{1}{2}"), parsed("1/2"), timeout_seconds=None)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            gold, answer = json.loads(line)
            ok = bool(verify(parsed_gold(gold), parsed(answer), timeout_seconds=None))
        except Exception:  # a parse or comparison that fails is a wrong answer, never a crash
            ok = False
        sys.stdout.write("1\n" if ok else "0\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
