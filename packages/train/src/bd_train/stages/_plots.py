"""Pictures for cards and reports: metric curves and a denoising trace unmasking step by step.

Each function returns PNG bytes (matplotlib, headless Agg backend), small enough to keep as an
artifact and to embed in a Metaflow card.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bd_data import ByteTokenizer


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(width, height), dpi=100)


def _png(plt, fig, margins: tuple[float, float, float, float] | None = None) -> bytes:
    """The figure as PNG bytes, laid out by `tight_layout` (which draws the figure once more), or
    with fixed `margins` (left, right, bottom, top, in inches) where that second draw is slow."""
    buffer = io.BytesIO()
    if margins is None:
        fig.tight_layout()
    else:
        width, height = fig.get_size_inches()
        left, right, bottom, top = margins
        fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height)
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def curves_png(history: Sequence[Mapping[str, float | int]], keys: Sequence[str], *, title: str) -> bytes | None:
    """One panel per metric key found in `history` (a list of {"step": s, key: value, ...}), at
    most three to a row: six panels in one row are too narrow to read."""
    keys = [k for k in keys if any(k in row for row in history)]
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    plt, fig = _figure(3.2 * cols, 2.6 * rows)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        points = [row for row in history if key in row]
        ax.plot([row["step"] for row in points], [row[key] for row in points], lw=1.5)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _png(plt, fig)


TRACE_COLUMNS = 32  # the widest trace picture drawn: at one token a step, 32 x 32 cells of text (about 1 s)


def trace_png(*, committed: np.ndarray, tokens: np.ndarray, step_valid: np.ndarray, block_ids: np.ndarray,
              first_block: int, num_blocks: int, block_size: int, token_text: Callable[[int], str],
              title: str, max_columns: int = TRACE_COLUMNS) -> bytes:
    """The completion canvas of one row after each denoising step (rows = steps, columns =
    completion positions): committed tokens as text, masks as grey, this step's commits highlighted.
    A completion wider than `max_columns` is shown by its first whole blocks that fit (at least
    one), with the steps that decoded them, and the title says how many: the whole of a 128-token
    completion decoded a token a step is 16,384 cells of text, a 5,480 x 4,200 picture that took
    matplotlib 29 s to draw, most of an evaluation's time on an accelerator.

    Arrays are one row of a `DiffusionTrace`: committed/tokens `[S, b]`, step_valid/block_ids `[S]`.
    """
    shown = min(num_blocks, max(1, max_columns // block_size))
    if shown < num_blocks:
        title = f"{title} (its first {shown} of {num_blocks} blocks)"
    width = shown * block_size
    steps = np.flatnonzero(step_valid & (np.asarray(block_ids) < first_block + shown))
    canvas = np.full(width, -1, np.int64)
    grid_state, grid_text = [], []
    for s in steps:
        offset = (int(block_ids[s]) - first_block) * block_size
        new = np.zeros(width, bool)
        for j in np.flatnonzero(committed[s]):
            canvas[offset + j] = tokens[s, j]
            new[offset + j] = True
        grid_state.append(np.where(new, 2, np.where(canvas >= 0, 1, 0)))
        grid_text.append([token_text(int(t)) if t >= 0 else "" for t in canvas])
    plt, fig = _figure(max(4.0, 0.42 * width + 1.0), max(1.6, 0.32 * len(steps) + 1.0))
    ax = fig.add_subplot(1, 1, 1)
    state = np.asarray(grid_state) if grid_state else np.zeros((1, width))
    colors = np.array([[0.85, 0.85, 0.85], [1.0, 1.0, 1.0], [0.55, 0.8, 1.0]])
    ax.imshow(colors[state.astype(int)], aspect="auto", interpolation="nearest")
    for r, row in enumerate(grid_text):
        for c, text in enumerate(row):
            ax.text(c, r, text, ha="center", va="center", fontsize=8 if len(text) <= 4 else 5, family="monospace")
    for boundary in range(block_size, width, block_size):
        ax.axvline(boundary - 0.5, color="black", lw=1)
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels([f"step {i + 1}" for i in range(len(steps))], fontsize=7)
    ax.set_xticks(range(width))
    ax.set_xticklabels([str(i) for i in range(width)], fontsize=6)
    ax.set_title(title, fontsize=9)
    return _png(plt, fig, margins=(0.8, 0.15, 0.45, 0.45))  # the step labels, the title


def trace_text(tokenizer: Any) -> Callable[[int], str]:
    """How a token is shown in the trace picture: ⏎ for end of text, · for a blank (spaces only).
    What does not print is escaped (`\\n`, `\\x07`), and a byte that is not UTF-8 on its own shows
    as `\\xNN` (a replacement character would pass for a digit); a token that decodes to nothing,
    or to undecodable bytes of a tokenizer that is not byte-level, shows its id as `#id`."""
    byte_level = isinstance(tokenizer, ByteTokenizer)

    def text(token: int) -> str:
        if token == tokenizer.eos_id:
            return "⏎"
        decoded = tokenizer.decode([token], stop_at_eos=False)
        if not decoded:
            return f"#{token}"
        if not decoded.strip(" "):
            return "·"
        if "\ufffd" in decoded:
            return f"\\x{token:02x}" if byte_level and 0 <= token < 256 else f"#{token}"
        return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in decoded)
    return text


def accuracy_nfe_png(series: Mapping[str, Sequence[Mapping[str, Any]]], *, title: str) -> bytes:
    """Held-out accuracy against NFE per generated token: one line per model, one labelled point
    per decoding setting (labels on the first model's line only, to stay readable)."""
    plt, fig = _figure(4.6, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, points) in enumerate(series.items()):
        xs, ys = [float(p["nfe_per_token"]) for p in points], [float(p["accuracy"]) for p in points]
        ax.plot(xs, ys, "o-", lw=1.5, ms=4, label=name)
        if i == 0:
            for p, x, y in zip(points, xs, ys):
                ax.annotate(str(p["decoding"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("NFE per generated token", fontsize=8)
    ax.set_ylabel("accuracy", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _png(plt, fig)
