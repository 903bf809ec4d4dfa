"""How the model's loops are traced for XLA's cost analysis, which counts a loop's body once
whatever its trip count: inside `unroll_layers()` the decoder's layer scan and the logits' chunk
loop (`logits_chunk`) are unrolled, so the program's count is its work (the plan's cost twins,
`bd_train.plan`). The arithmetic is the same either way."""

from __future__ import annotations

import contextlib
import contextvars

_UNROLL = contextvars.ContextVar("bd_models_unroll_layers", default=False)


@contextlib.contextmanager
def unroll_layers():
    """Trace the decoder fully unrolled inside this block: one copy of the layer per layer, and of
    the logits' computation per chunk of positions (`logits_chunk`). The same arithmetic; XLA's
    cost analysis counts a loop's body once whatever its trip count, so ahead-of-time FLOP and time
    estimates lower the model this way."""
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def unrolled() -> bool:
    """Whether the model's loops are traced unrolled (inside `unroll_layers`)."""
    return _UNROLL.get()
