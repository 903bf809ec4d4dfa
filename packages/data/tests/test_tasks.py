"""Digit tasks: deterministic random access, disjoint splits, reference answers, bounded rewards."""

import time

import pytest

from bd_core import ConfigError
from bd_data import DEFAULT_TASK, PARTIAL_CREDIT, TASKS, ByteTokenizer, Example, PatternTask, get_task

DIGIT_TASKS = sorted(name for name, cls in TASKS.items() if issubclass(cls, PatternTask))


def _reference(name, prompt):
    """Answers recomputed from the prompt text alone."""
    body = prompt[:-1]
    if name == "sort":
        return "".join(sorted(body))
    if name == "argsort":
        return "".join(str(i) for i in sorted(range(len(body)), key=lambda i: (body[i], i)))
    a, b = body.split("+")
    if name == "addition":
        return str(int(a) + int(b))
    return str(int(a[::-1]) + int(b[::-1]))[::-1]


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_answers_match_reference_and_fit_small_canvas(name):
    task, tok = get_task(name, seed=3), ByteTokenizer()
    for split in ("train", "eval"):
        for i in range(200):
            ex = task.example(i, split)
            assert ex.prompt.endswith("=") and ex.answer == _reference(name, ex.prompt)
            assert len(tok.encode(ex.prompt)) <= 16 and len(tok.encode(ex.answer)) <= 7  # P=16, N=8 with eos
            assert task.reward(ex, ex.answer) == 1.0 and task.is_correct(ex, f" {ex.answer}\n")


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_random_access_is_deterministic_and_splits_are_disjoint(name):
    task = get_task(name, seed=7)
    order = [5, 0, 99, 5, 42]
    assert [task.example(i) for i in order] == [get_task(name, seed=7).example(i) for i in order]
    assert [task.example(i) for i in range(50)] != [get_task(name, seed=8).example(i) for i in range(50)]
    train = {task.example(i, "train").prompt for i in range(3000)}
    held = {task.example(i, "eval").prompt for i in range(300)}
    assert not train & held
    # The smallest space (2-digit LSD addition) holds ~1000 eval problems: ~259 distinct in 300 draws.
    assert len(held) > 200


def test_difficulty_params_and_registry_errors():
    assert DEFAULT_TASK in TASKS and DIGIT_TASKS == ["addition", "addition_lsd", "argsort", "sort"]
    assert {"countdown", "mini_sudoku", "chain_sum", "math"} <= set(TASKS)
    assert len(get_task("sort", length=9).example(0).answer) == 9
    assert len(get_task("addition", digits=5).example(0).prompt) == 12
    with pytest.raises(ConfigError, match=r"^task: expected one of \[.*'addition'.*\], got 'mul'"):
        get_task("mul")
    with pytest.raises(ConfigError, match=r"SortTask.digits: expected a parameter of task 'sort' \(one of .*'length'"):
        get_task("sort", digits=3)
    with pytest.raises(ConfigError, match=r"SortTask.length: expected an int in \[2, 16\]"):
        get_task("sort", length=1)
    with pytest.raises(ValueError, match="split"):
        get_task("sort").example(0, "test")


ADVERSARIAL = [
    "9" * 10_000_000,
    "1" * 200,
    "(" * 100_000 + ")" * 100_000,
    "2**" * 100_000 + "2",
    "__import__('os').system('true')",
    "[" * 50_000,
    "\x00" * 1000,
    "٣٤٥",  # non-ASCII digits are not the answer format
    "",
]


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_rewards_right_wrong_malformed_adversarial(name):
    task = get_task(name)
    ex = task.example(11)
    wrong = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    assert task.reward(ex, ex.answer) == 1.0
    assert task.reward(ex, wrong) == PARTIAL_CREDIT and not task.is_correct(ex, wrong)
    assert task.reward(ex, ex.answer + "x") == 0.0
    assert task.reward(ex, "abc") == 0.0
    for text in ADVERSARIAL:
        start = time.perf_counter()
        assert task.reward(ex, text) == 0.0, text[:20]
        assert time.perf_counter() - start < 0.05


def test_partial_credit_is_format_specific():
    sort = get_task("sort", length=6)
    ex = Example("315926=", "123569")
    assert sort.reward(ex, "12356") == 0.0  # wrong length is malformed for sort
    add = get_task("addition", digits=3)
    ex = Example("042+317=", "359")
    assert add.reward(ex, "1000") == PARTIAL_CREDIT and add.reward(ex, "10000") == 0.0


@pytest.mark.parametrize("name", ["sort", "argsort"])
def test_positional_credit_scores_the_fraction_of_right_positions(name):
    exact, positions = get_task(name, seed=1), get_task(name, seed=1, credit="positions")
    ex = exact.example(0)
    wrong_last = ex.answer[:-1] + str((int(ex.answer[-1]) + 1) % 10)
    assert exact.reward(ex, wrong_last) == PARTIAL_CREDIT
    assert positions.reward(ex, wrong_last) == 5 / 6 and positions.reward(ex, f" {ex.answer}\n") == 1.0
    assert not positions.is_correct(ex, wrong_last)  # only the exact answer counts as correct
    # malformed stays 0 whatever the overlap; a long right-looking completion is malformed too
    assert positions.reward(ex, ex.answer + "0") == 0.0 and positions.reward(ex, ex.answer * 100) == 0.0
    with pytest.raises(ConfigError, match=r"credit: expected 'form' or 'positions', got 'half'"):
        get_task(name, credit="half")
