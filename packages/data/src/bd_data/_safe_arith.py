"""Exact arithmetic on untrusted text: `+ - * /` over integer literals, never through `eval`.

A grammar check (ASCII digits, `+ - * / ( )` and spaces; bounded length and nesting; no `**` or
`//`) runs before `ast.parse`; the tree is walked over a whitelist of nodes with exact rationals,
and an intermediate value whose numerator or denominator outgrows `MAX_BITS` stops the walk.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

MAX_CHARS = 256
MAX_DEPTH = 32  # parentheses; far below the parser's limit, so parsing cannot recurse deeply
MAX_BITS = 4096  # 256 characters of literals stay under ~900 bits; this is defence in depth

_GRAMMAR = re.compile(r"[0-9+\-*/() ]+")  # explicit ASCII classes: no Unicode digits, no names
_LITERAL = re.compile(r"[0-9]+")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class ArithmeticRejected(ValueError):
    """Text that is not a well-formed, evaluable `+ - * /` expression within the limits."""


def _check_grammar(text: str) -> None:
    if len(text) > MAX_CHARS:
        raise ArithmeticRejected(f"longer than {MAX_CHARS} characters")
    if not _GRAMMAR.fullmatch(text) or "**" in text or "//" in text:
        raise ArithmeticRejected("characters outside digits, + - * / ( ) and spaces, or ** or //")
    depth = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        if depth > MAX_DEPTH or depth < 0:
            raise ArithmeticRejected(f"parentheses unbalanced or nested deeper than {MAX_DEPTH}")


def _evaluate(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ArithmeticRejected("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
            raise ArithmeticRejected(f"an intermediate value exceeds {MAX_BITS} bits")
        return value
    raise ArithmeticRejected(f"{type(node).__name__} is not allowed")


def evaluate_arithmetic(text: str) -> Fraction:
    """The exact value of `text`, or `ArithmeticRejected`; linear-time checks come first."""
    _check_grammar(text)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ArithmeticRejected(f"not an expression ({type(err).__name__})") from None
    return _evaluate(tree.body)


def literals(text: str) -> list[int]:
    """The integer literals of `text`, in order (for text that passed the grammar check)."""
    return [int(match) for match in _LITERAL.findall(text)]
