"""Model FLOPs: matmuls plus attention over the entries the mask allows.

A multiply-add counts 2 FLOPs; the backward pass counts twice the forward, so a training step is
3x forward. Given a `ViewLayout`, attention counts the allowed (query, key) pairs exactly; given a
`(B, T)` shape, every pair. Shape letters: see bd_core.
"""

from __future__ import annotations

import numpy as np

from bd_core import ViewLayout, attention_allowed

from ._config import ModelConfig


def attention_entries(layout: ViewLayout) -> int:
    """Allowed (query, key) pairs summed over the batch (row by row, to keep memory at T²)."""
    total = 0
    for row in range(layout.shape[0]):
        one = ViewLayout(*(np.asarray(a)[row:row + 1] for a in (layout.tokens, layout.positions, layout.block_ids,
                                                                 layout.view_ids, layout.valid)))
        total += int(np.sum(np.asarray(attention_allowed(one))))
    return total


def model_flops(config: ModelConfig, layout_or_shape: ViewLayout | tuple[int, int]) -> dict[str, float]:
    """`matmul_forward`, `attention_forward`, `forward` and `train_step` FLOPs for one batch."""
    if isinstance(layout_or_shape, ViewLayout):
        batch, length = layout_or_shape.shape
        entries = attention_entries(layout_or_shape)
    else:
        batch, length = layout_or_shape
        entries = batch * length * length
    d, e, f = config.d_model, config.head_dim, config.d_ff
    h, kv = config.n_heads, config.n_kv_heads
    per_token_layer = 2 * d * (h * e + 2 * kv * e) + 2 * h * e * d + 2 * 3 * d * f
    matmul = batch * length * (config.n_layers * per_token_layer + 2 * d * config.vocab_size)
    # Scores (q·k) and the weighted sum of values, each a multiply-add per head dim.
    attention = config.n_layers * h * entries * 4 * e
    forward = matmul + attention
    return {"matmul_forward": float(matmul), "attention_forward": float(attention), "forward": float(forward),
            "train_step": float(3 * forward), "attention_entries": float(entries)}
