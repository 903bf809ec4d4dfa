"""grain pipelines: examples → canvases → batches → corrupted `DiffusionTokenBatch`es, and prompt batches.

Everything is a `MapDataset` until `iterate`, so element i depends only on the seed and i: the
same seed gives the same batches, and an iterator's `get_state()` restores to the identical next
batch. Corruption runs per batch (not per example) so t can be stratified over the batch.
Shape letters: see bd_core (B, P, N, C = P + N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grain
import numpy as np

from bd_core import DiffusionTokenBatch

from ._canvas import Canvas, CanvasConfig, build_canvas, prompt_canvas
from ._corruption import DEFAULT_CORRUPTION, CorruptionConfig, corrupt
from ._example import Example


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompts for rollouts: tokens `[B, P]` int32, valid `[B, P]` bool, canvas
    positions `[B, C]` int32, source indices `[B]` int64, and the examples (for rewards).

    Attributes:
        tokens: `[B, P]` left-padded prompt ids.
        valid: `[B, P]` False for padding.
        positions: `[B, C]` canvas positions.
        index: `[B]` the examples' indices in their source.
        examples: the examples themselves (for rewards).
    """

    tokens: np.ndarray
    valid: np.ndarray
    positions: np.ndarray
    index: np.ndarray
    examples: tuple[Example, ...]

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(example.answer for example in self.examples)


def _seeds(seed: int) -> tuple[int, int]:
    """Independent shuffle and corruption seeds from one user seed."""
    shuffle_seed, noise_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(shuffle_seed), int(noise_seed)


def _shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if (shard_index is None) != (shard_count is None):
        raise ValueError("pass both shard_index= and shard_count= or neither (then the JAX process index/count)")
    if shard_index is None:
        import jax

        return jax.process_index(), jax.process_count()
    if not (isinstance(shard_count, int) and shard_count >= 1 and isinstance(shard_index, int)
            and 0 <= shard_index < shard_count):
        raise ValueError(f"expected 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                         f"shard_count={shard_count}")
    return shard_index, shard_count


def _examples(source: Sequence[Example], *, seed: int, batch_size: int, shard_index, shard_count, shuffle: bool,
              num_epochs: int | None) -> grain.MapDataset:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs: expected None (repeat forever) or >= 1, got {num_epochs}")
    index, count = _shard(shard_index, shard_count)
    ds = grain.MapDataset.source(source)[index::count]
    if len(ds) == 0:
        raise ValueError(f"shard {index} of {count} of a source of {len(source)} examples is empty")
    if shuffle:
        ds = ds.shuffle(seed=_seeds(seed)[0])
    return ds if num_epochs == 1 else ds.repeat(num_epochs)


@dataclasses.dataclass(frozen=True)
class _ToCanvas:
    tokenizer: object
    canvas: CanvasConfig

    def __call__(self, example: Example) -> Canvas:
        return build_canvas(*example.token_ids(self.tokenizer), self.canvas, self.tokenizer)


def _stack_canvases(canvases: Sequence[Canvas]) -> Canvas:
    return Canvas(*(np.stack([getattr(c, f.name) for c in canvases]) for f in dataclasses.fields(Canvas)))


@dataclasses.dataclass(frozen=True)
class _Corrupt:
    canvas: CanvasConfig
    corruption: CorruptionConfig
    mask_id: int

    def __call__(self, batch: Canvas, rng: np.random.Generator) -> DiffusionTokenBatch:
        return corrupt(batch, self.canvas, self.corruption, mask_id=self.mask_id, rng=rng)


def sft_dataset(source: Sequence[Example], tokenizer, canvas: CanvasConfig,
                corruption: CorruptionConfig = DEFAULT_CORRUPTION, *, seed: int, batch_size: int,
                shard_index: int | None = None, shard_count: int | None = None, shuffle: bool = True,
                num_epochs: int | None = None, drop_remainder: bool = True) -> grain.MapDataset:
    """Batches of numpy `DiffusionTokenBatch`es `[B, P + N + K*N]` (K = `corruption.views`); this
    process's shard of `source`.

    `num_epochs=None` repeats forever (reshuffled every epoch). Element i depends only on
    (seed, i, shard), so indexing the dataset is as deterministic as iterating it.

    Example:
        ```python
        from bd_data import ByteTokenizer, CanvasConfig, CorruptionConfig, get_task, iterate, sft_dataset

        task, tok = get_task("argsort", length=6), ByteTokenizer()
        canvas = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
        data = sft_dataset(task.dataset("train"), tok, canvas, CorruptionConfig(), seed=0, batch_size=64)
        batch = next(iterate(data))
        assert batch.layout.tokens.shape == (64, 24)  # prompt + completion | a noisy copy of the completion
        ```
    """
    ds = _examples(source, seed=seed, batch_size=batch_size, shard_index=shard_index, shard_count=shard_count,
                   shuffle=shuffle, num_epochs=num_epochs)
    ds = ds.map(_ToCanvas(tokenizer, canvas)).batch(batch_size, drop_remainder=drop_remainder, batch_fn=_stack_canvases)
    return ds.random_map(_Corrupt(canvas, corruption, tokenizer.mask_id), seed=_seeds(seed)[1])


@dataclasses.dataclass(frozen=True)
class _ToPrompt:
    tokenizer: object
    canvas: CanvasConfig

    def __call__(self, example: Example):
        tokens, valid, positions = prompt_canvas(example.token_ids(self.tokenizer)[0], self.canvas, self.tokenizer)
        return tokens, valid, positions, example


def _stack_prompts(items) -> PromptBatch:
    tokens, valid, positions, examples = zip(*items)
    index = np.asarray([example.index for example in examples], np.int64)
    return PromptBatch(np.stack(tokens), np.stack(valid), np.stack(positions), index, tuple(examples))


def prompt_dataset(source: Sequence[Example], tokenizer, canvas: CanvasConfig, *, seed: int, batch_size: int,
                   shard_index: int | None = None, shard_count: int | None = None, shuffle: bool = True,
                   num_epochs: int | None = None, drop_remainder: bool = True) -> grain.MapDataset:
    """Batches of `PromptBatch` for rollouts. For an evaluation pass over every example use
    `shuffle=False, num_epochs=1, drop_remainder=False`."""
    ds = _examples(source, seed=seed, batch_size=batch_size, shard_index=shard_index, shard_count=shard_count,
                   shuffle=shuffle, num_epochs=num_epochs)
    return ds.map(_ToPrompt(tokenizer, canvas)).batch(batch_size, drop_remainder=drop_remainder,
                                                      batch_fn=_stack_prompts)


def iterate(dataset: grain.MapDataset, *, worker_count: int = 0, prefetch: int = 2) -> grain.DatasetIterator:
    """An iterator with `get_state()/set_state()` (and grain.checkpoint support).

    In-process with one prefetch thread by default; `worker_count > 0` uses worker processes
    (they need absl flags parsed and a `__main__` guard, and take seconds to start). A saved
    state restores into an iterator made with the same `worker_count`.
    """
    if worker_count < 0 or prefetch < 0:
        raise ValueError(f"worker_count and prefetch must be >= 0, got {worker_count}, {prefetch}")
    threads = 1 if prefetch else 0
    ds = dataset.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch))
    if worker_count:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(ds)
