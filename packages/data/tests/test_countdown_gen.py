"""bdlm's countdown problems are reasoning-gym's own, entry for entry: same problems, answers,
prompts and metadata for any seed, index and configuration (the task's default, wider ranges,
operator subsets where division's fallbacks decide the answer, no shuffling), and the same
refusals where the library gives up."""

import pytest
import reasoning_gym

from bd_data import get_task
from bd_data._countdown_gen import countdown_problems

CONFIGS = [
    dict(min_numbers=3, max_numbers=3, min_value=1, max_value=10, min_target=10, max_target=50),  # the presets'
    dict(min_numbers=2, max_numbers=6, min_value=1, max_value=100, min_target=1, max_target=1000),
    dict(min_numbers=3, max_numbers=5, min_value=1, max_value=12, min_target=1, max_target=200, operators=("/", "+")),
    dict(min_numbers=4, max_numbers=4, min_value=1, max_value=9, min_target=1, max_target=100, operators=("/",),
         shuffle=False),
    dict(min_numbers=2, max_numbers=4, min_value=1, max_value=6, min_target=1, max_target=300, operators=("*", "+")),
]


def _entry(dataset, j):
    """Entry `j`, or the error the generator gives up with (the same in both, or the test fails)."""
    try:
        return dataset[j]
    except ValueError as err:
        return f"ValueError: {err}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['min_numbers']}-{c['max_numbers']}"
                         f"{''.join(c.get('operators', '+-*/'))}")
def test_entries_equal_the_librarys(config):
    indices = list(range(120)) + [(j * 2654435761) % (1 << 62) for j in range(120)]  # the task draws j < 2**62
    for seed in (0, 11):
        library = reasoning_gym.create_dataset("countdown", seed=seed, size=1 << 62, **config)
        ours = countdown_problems(seed=seed, size=1 << 62, **config)
        for j in indices:
            assert _entry(ours, j) == _entry(library, j), (seed, j)


def test_the_task_makes_the_librarys_problems():
    """A task's examples come from the faster generator, and equal the library's, exactly."""
    task = get_task("countdown", seed=3)
    assert type(task.library_dataset()).__name__ == "CountdownProblems"
    library = reasoning_gym.create_dataset("countdown", size=1 << 30, **task.library_config())
    for j in (0, 1, 12345, (1 << 62) - 1):
        assert task.from_entry(task.library_dataset()[j]) == task.from_entry(library[j])
