"""What making countdown problems costs: reasoning-gym's own generator (sympy builds, evaluates and
prints every candidate expression) against bdlm's `CountdownProblems` (the same entries, made
without sympy in the loop), per problem, and per SFT batch of the default preset (64 problems made,
placed on the canvas, stacked and corrupted). The entries are checked equal on the way. Median of
3 rounds. Writes bench/results/countdown_data.json and its BENCHMARKS.md section.

    python bench/countdown_data.py
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import tomllib

import reasoning_gym
from _report import ROOT, write_results, write_section

from bd_data import ByteTokenizer, CountdownTask, sft_dataset
from bd_train.stages import parse_pipeline_config, pipeline_config

PROBLEMS, BATCHES, ROUNDS = 2000, 40, 3


@dataclasses.dataclass(frozen=True)
class _LibraryCountdown(CountdownTask):
    """The task with reasoning-gym's own generator behind it (another class: its own example cache)."""

    def library_dataset(self):
        return _library(tuple(sorted(self.library_config().items())))


@functools.cache
def _library(config):
    return reasoning_gym.create_dataset("countdown", size=1 << 30, **dict(config))


def _per_item(make, indices) -> float:
    start = time.perf_counter()
    for j in indices:
        make(j)
    return (time.perf_counter() - start) / len(indices)


def main() -> None:
    preset = (ROOT / "flows" / "configs" / "default.toml").read_text()
    config = pipeline_config(parse_pipeline_config(tomllib.loads(preset)))
    task = CountdownTask(**config.task.params)
    settings = dict(size=1 << 30, **task.library_config())
    library, ours = reasoning_gym.create_dataset("countdown", **settings), task.library_dataset()
    offset = 0
    times: dict[str, list[float]] = {"library": [], "ours": [], "batch": [], "library_batch": []}
    for _ in range(ROUNDS):
        indices = range(offset, offset + PROBLEMS)
        assert [ours[j] for j in indices[:200]] == [library[j] for j in indices[:200]]
        times["library"].append(_per_item(library.__getitem__, indices))
        times["ours"].append(_per_item(ours.__getitem__, indices))
        # the default preset's SFT batches, of problems never made before (their cache is cold)
        for name, kind in (("batch", CountdownTask), ("library_batch", _LibraryCountdown)):
            source = kind(seed=1000 + offset, **config.task.params).dataset("train")
            data = sft_dataset(source, ByteTokenizer(), config.canvas, config.sft.corruption, seed=offset,
                               batch_size=config.sft.batch_size, shard_index=0, shard_count=1)
            times[name].append(_per_item(data.__getitem__, range(BATCHES)))
        offset += PROBLEMS
    median = {k: statistics.median(v) for k, v in times.items()}
    results = {"library_ms": median["library"] * 1e3, "ours_ms": median["ours"] * 1e3,
               "speedup": median["library"] / median["ours"], "batch_ms": median["batch"] * 1e3,
               "library_batch_ms": median["library_batch"] * 1e3, "batch_size": config.sft.batch_size}
    write_results("countdown_data", results)
    body = f"""## Making countdown problems (`bench/countdown_data.py`)

reasoning-gym's countdown generator builds, evaluates and prints every candidate expression with
sympy; `bd_data`'s `CountdownProblems` makes the same entries (checked equal here, and dict for
dict in `packages/data/tests/test_countdown_gen.py`) from the same random draws, with exact
`Fraction` arithmetic and sympy's text cached per operator sequence. The default preset's task
(3 numbers of 1-10, targets 10-50), one thread, median of {ROUNDS} rounds of {PROBLEMS:,} problems.

| | ms per problem | ms per SFT batch of {config.sft.batch_size} |
|---|---|---|
| reasoning-gym | {results["library_ms"]:.2f} | {results["library_batch_ms"]:.0f} |
| `CountdownProblems` | {results["ours_ms"]:.3f} | {results["batch_ms"]:.0f} |

A batch is its problems made, placed on the canvas, stacked and corrupted (a train split's example
may take more than one draw). The default run's teacher sees 96,000 problems in its 1,500 SFT
steps, made on the same two cores as its training: in `make run` from a fresh clone its SFT took
5 min 32 s before and 4 min 5 s after, and the run after its set-up 8 min 17 s before and about
6 min 30 s after (7 min 30 s with the set-up), its summary unchanged to the bit."""
    write_section("countdown_data", body)
    print(body)


if __name__ == "__main__":
    main()
