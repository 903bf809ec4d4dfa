"""The math example (examples/math, flows/configs/math.toml): its generator rewrites the committed
files byte for byte, math-verify accepts every eval answer and its equivalent forms and refuses a
wrong one, and the preset parses, keeps the splits disjoint and fits every problem on its canvas."""

import importlib.util
import tomllib
from fractions import Fraction
from pathlib import Path

import pytest

from bd_data import ByteTokenizer, CanvasConfig, MathTask, fit_to_canvas
from bd_train.stages import parse_pipeline_config, pipeline_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "math"
PRESET = ROOT / "flows" / "configs" / "math.toml"


def _generator():
    spec = importlib.util.spec_from_file_location("make_math", EXAMPLE / "make_math.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task() -> MathTask:
    params = tomllib.loads(PRESET.read_text())["task"]["params"]
    return MathTask(path=str(ROOT / params["path"]), eval_path=str(ROOT / params["eval_path"]))


def test_the_generator_rewrites_the_committed_files_byte_for_byte(tmp_path):
    written = _generator().write(tmp_path)
    for split in ("train", "eval"):
        assert written[split].read_bytes() == (EXAMPLE / f"{split}.jsonl").read_bytes(), split


def test_math_verify_accepts_each_eval_answer_and_its_equivalent_forms_only(task):
    make_math = _generator()
    problems = make_math.problems()["eval"]
    assert task.split_size("eval") == len(problems) == 200 and task.split_size("train") == 600
    rewritten = 0
    for i, (prompt, value) in enumerate(problems):
        example = task.example(i, "eval")
        assert example.prompt == prompt
        forms = {example.answer, make_math.plain(value), f"\\boxed{{{make_math.plain(value)}}}"}
        if value.denominator != 1:  # unreduced, as a small model writes it: 6/8 for 3/4
            forms.add(f"{value.numerator * 2}/{value.denominator * 2}")
        rewritten += example.answer != make_math.plain(value)
        for form in forms:
            assert task.reward(example, form) == 1.0, (prompt, example.answer, form)
        for wrong in (value + 1, -value if value else Fraction(1, 2), value + Fraction(1, 100)):
            assert task.reward(example, make_math.plain(wrong)) < 1.0, (prompt, example.answer, wrong)
    # The eval file writes each non-integer answer as a decimal or \frac{}{}: exact match would miss them.
    assert rewritten == 87
    assert any("." in task.example(i, "eval").answer for i in range(len(problems)))


def test_the_preset_parses_with_disjoint_splits_that_fit_its_canvas(task):
    config = pipeline_config(parse_pipeline_config(PRESET.read_text()))
    assert config.task.name == "math" and config.eval.n == task.split_size("eval")
    canvas: CanvasConfig = config.canvas
    tokenizer = ByteTokenizer()
    splits = {split: [task.example(i, split) for i in range(task.split_size(split))] for split in ("train", "eval")}
    assert not {e.prompt for e in splits["train"]} & {e.prompt for e in splits["eval"]}
    for example in splits["train"]:  # raises CanvasOverflow if answer + eos or the prompt do not fit
        fit_to_canvas(tokenizer.encode(example.prompt), tokenizer.encode(example.answer), canvas)
    assert max(len(e.prompt.encode()) for e in splits["eval"]) <= canvas.prompt_len
