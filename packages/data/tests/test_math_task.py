"""The math task: JSONL loading and errors, disjoint splits, math-verify agreement, and rewards
bounded in time from any thread (a worker process under a deadline)."""

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from math_verify import parse, verify

from bd_core import ConfigError
from bd_data import Example, JsonlError, MathTask, get_task, verify_math

GOLDS = ["\\frac{1}{2}", "3", "-41", "\\sqrt{2}", "x^2+1", "0.25", "\\{1, 2\\}", "2\\pi"]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("math")
    rows = [{"prompt": f"Problem {i}: what is it?", "answer": GOLDS[i % len(GOLDS)]} for i in range(300)]
    return root, _write(root / "all.jsonl", rows), rows


def test_one_file_splits_by_prompt_and_eval_file_is_deduped_out_of_train(data):
    root, path, rows = data
    task = get_task("math", path=path)
    train = [task.example(i).prompt for i in range(task.split_size("train"))]
    held = [task.example(i, "eval").prompt for i in range(task.split_size("eval"))]
    assert not set(train) & set(held) and len(train) + len(held) == len(rows) and 10 < len(held) < 60
    assert list(task.dataset("eval")) == [task.example(i, "eval") for i in range(len(held))]
    assert get_task("math", path=path, seed=9).example(4) == task.example(4)  # the file decides, not the seed
    eval_path = _write(root / "eval.jsonl", rows[:20] + [{"prompt": "new", "answer": "1"}])
    split = get_task("math", path=path, eval_path=eval_path)
    assert split.split_size("eval") == 21 and split.split_size("train") == len(rows) - 20
    assert not {split.example(i).prompt for i in range(280)} & {r["prompt"] for r in rows[:20]}
    with pytest.raises(IndexError, match="the train split"):
        split.example(280)


def test_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    with pytest.raises(JsonlError, match=rf"^{bad}:3: missing field 'answer'"):
        get_task("math", path=str(bad))
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": 2}\n')
    with pytest.raises(JsonlError, match=rf"^{bad}:2: field 'answer' must be a string"):
        get_task("math", path=str(bad))
    bad.write_text('{"prompt": "a", "answer": 1/2}\n')
    with pytest.raises(JsonlError, match=rf"^{bad}:1: invalid JSON"):
        get_task("math", path=str(bad))
    with pytest.raises(ConfigError, match=r"^MathTask.path: expected an existing JSONL file .*; nothing is at "
                                          r"'.*missing.jsonl' \(a relative path starts at the folder the command runs"):
        get_task("math", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"^MathTask.eval_path: expected an existing JSONL file"):
        get_task("math", path=str(bad), eval_path=str(tmp_path / "missing.jsonl"))
    tiny = _write(tmp_path / "tiny.jsonl", [{"prompt": "Problem 0: what is it?", "answer": "1"}])
    with pytest.raises(JsonlError, match="none of its 1 records falls in the eval split.*pass eval_path="):
        get_task("math", path=tiny)
    with pytest.raises(ConfigError, match=r"^MathTask.path: expected the path of a JSONL file"):
        get_task("math")
    with pytest.raises(ConfigError, match=r"^MathTask.timeout_s: expected a number of seconds in \(0, 60\]"):
        get_task("math", path=tiny, timeout_s=0)


def test_rewards_agree_with_math_verify(data):
    task = get_task("math", path=data[1])
    cases = {"\\frac{1}{2}": ["0.5", "1/2", "\\boxed{\\frac12}", "$\\frac{2}{4}$", "0.6", "The answer is 1/3"],
             "3": ["3", "3.0", "The answer is $3$", "4", "-3"],
             "$x^2+1$": ["$1+x^2$", "$x^2-1$", "\\boxed{x^2+1}"],
             "$\\sqrt{2}$": ["$\\sqrt{2}$", "$2^{1/2}$", "$1.41$"]}
    for gold, completions in cases.items():
        ex = Example("q", gold)
        assert task.reward(ex, gold) == 1.0 and verify(parse(gold), parse(gold))
        for text in completions:
            assert task.reward(ex, text) == float(verify(parse(gold), parse(text))), (gold, text)
    # Bare answers with no delimiters are read as inline math too (math-verify alone finds nothing).
    assert task.reward(Example("q", "\\sqrt{2}"), "\\sqrt{2}") == 1.0 and parse("\\sqrt{2}") == []


def test_bare_latex_answers_are_read_whole_not_by_their_leading_number(data):
    """Read as plain text, math-verify finds only the leading number of `3\\sqrt{2}`, `2^{10}` or
    `4\\pi` (3, 2, 4): a gold answer in MATH's usual form scored the wrong completion `3` as
    correct and `\\sqrt{18}` as wrong. Gold answers, and completions that look like LaTeX, are read
    as inline math first; prose around a number is still read as plain text."""
    task = get_task("math", path=data[1])
    cases = {("3\\sqrt{2}", "3"): 0.0, ("3\\sqrt{2}", "\\sqrt{18}"): 1.0, ("3\\sqrt{2}", "$3\\sqrt{2}$"): 1.0,
             ("2^{10}", "2"): 0.0, ("2^{10}", "1024"): 1.0, ("4\\pi", "4"): 0.0, ("4\\pi", "4\\pi"): 1.0,
             ("(1, 2)", "(1,2)"): 1.0, ("7", "it is not 6, it is 7"): 1.0, ("7", "6"): 0.0,
             ("x = 3", "3"): 1.0, ("\\frac{1}{2}", "so it is \\frac{1}{2}."): 1.0,
             ("2", "Since x^2 = 4 and x > 0, x = 2"): 1.0, ("9", "3^2 is 9"): 1.0, ("x^2+1", "x^2+1"): 1.0}
    for (gold, completion), reward in cases.items():
        assert task.reward(Example("q", gold), completion) == reward, (gold, completion)
    assert parse("3\\sqrt{2}")[0] == 3  # what plain text gives


ADVERSARIAL = [
    "9**9**9",
    "9^{9^{9}}",
    "(" * 10_000 + "1" + ")" * 10_000,
    "\\boxed{" + "(" * 7 + "1" + ")" * 7 + "}",  # each ( level costs math-verify's parser ~0.05-0.1 s
    "\\boxed{10^{99999}}",
    "99999!",
    "9" * 1_000_000,
    "__import__('os').system('touch x')",
    "\x00" * 1000,
    "\\frac{1}{2}\x00",
    b"\\frac{1}{\xff2}".decode("utf-8", errors="replace"),
    ("\\frac{\\sqrt{2}}{3}+" * 6000)[:100_000],  # 100 KB of LaTeX
    "   ",
]


def _check_adversarial(task, ex, extra):
    for text in [*ADVERSARIAL, *extra, b"\\frac{1}{2}", None]:
        start = time.perf_counter()
        value = task.reward(ex, text)
        assert time.perf_counter() - start < 0.2, repr(text)[:40]
        assert math.isfinite(value) and value == 0.0, repr(text)[:40]


def test_adversarial_completions_are_fast_finite_and_inert(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(data[0]))
    task = get_task("math", path=data[1])
    ex = Example("q", "\\frac{1}{2}")
    assert task.reward(ex, "0.5") == 1.0  # the worker is up before anything is timed
    attack = [f"__import__('os').system('touch {tmp_path / 'y'}')", f"open('{tmp_path / 'z'}', 'w')"]
    _check_adversarial(task, ex, attack)
    failures = []
    worker = threading.Thread(target=lambda: failures.extend(_safe(_check_adversarial, task, ex, attack)))
    worker.start()
    worker.join()
    assert not failures and os.listdir(tmp_path) == [] and set(os.listdir(data[0])) == before


def _safe(check, *args):
    try:
        check(*args)
    except AssertionError as err:
        return [err]
    return []


def test_slow_answers_stop_at_the_deadline_in_any_thread(data):
    """An input the screen lets through but sympy takes a minute on: the worker is killed at the
    deadline and replaced, so the next answer is scored as usual."""
    task = MathTask(path=data[1], timeout_s=0.3)
    ex = Example("q", "\\frac{1}{2}")
    slow = "\\boxed{\\binom{999999}{499999}}"

    def timed():
        start = time.perf_counter()
        value = task.reward(ex, slow)
        return value, time.perf_counter() - start, task.reward(ex, "1/2")

    assert task.reward(ex, "1/2") == 1.0
    value, seconds, after = timed()
    assert value == 0.0 and 0.3 <= seconds < 1.5 and after == 1.0  # `after` waits for the new worker
    with ThreadPoolExecutor(2) as pool:
        value, seconds, after = pool.submit(timed).result()
        assert value == 0.0 and seconds < 2.5 and after == 1.0
        assert list(pool.map(lambda text: task.reward(ex, text), ["0.5", "2/4", "0.4", "1"])) == [1, 1, 0, 0]
    assert verify_math("\\frac{1}{2}", slow, timeout_s=0.3) is None
