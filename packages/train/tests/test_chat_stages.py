"""`[task] chat_template`: the rendered prompts reach SFT's canvases, OPD's and GRPO's prompt
batches and the evaluation (through the stages' own helpers, without training); the template's
text is pinned in the training fingerprint; mistakes are refused naming `task.chat_template`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from bd_core import ConfigError, FingerprintMismatch, require_compatible
from bd_data import ChatTemplate, prompt_dataset
from bd_train.stages import Run, StageError, check_adopted, parse_pipeline_config
from bd_train.stages._evaluate import eval_examples

FIXTURES = Path(__file__).resolve().parents[2] / "models" / "tests" / "fixtures" / "hf"
CHATML = FIXTURES / "chatml"


def _preset(tokenizer_folder: Path | None = CHATML, chat_template: object = True, prompt_len: int = 80,
            **task) -> dict:
    built_in = {} if "train_jsonl" in task else {"name": "sort", "params": {"length": 4}}
    preset = {"task": {**built_in, "chat_template": chat_template, **task},
              "canvas": {"prompt_len": prompt_len, "max_new_tokens": 8, "block_size": 4},
              "sft": {"batch_size": 4}, "eval": {"n": 6}}
    if tokenizer_folder is not None:
        preset["tokenizer"] = {"path": str(tokenizer_folder / "tokenizer.json")}
    return preset


def _valid_prompt(tokens: np.ndarray, valid: np.ndarray) -> list[int]:
    assert valid.any() and not valid[: np.argmax(valid)].any()  # left-padded
    return tokens[valid].tolist()


def test_templated_prompts_reach_sft_opd_grpo_and_evaluation():
    run = Run(parse_pipeline_config(_preset()))
    tok, template = run.tokenizer, run.chat_template
    assert tok.eos_id == tok.encode_markup("<|im_end|>")[0]  # the tokenizer_config's eos
    assert template.source == ChatTemplate.from_tokenizer(CHATML).source
    before, after = (tok.encode_markup(part).tolist() for part in template.render("\0").split("\0"))
    prompt_len = run.config.canvas.prompt_len

    # SFT: each canvas's prompt is a rendered sort prompt (markup ids, then the prompt as text)
    batch = next(run.sft_batches("sft-student"))
    for tokens, valid in zip(np.asarray(batch.layout.tokens), np.asarray(batch.layout.valid), strict=True):
        ids = _valid_prompt(tokens[:prompt_len], valid[:prompt_len])
        assert ids[:len(before)] == before and ids[len(ids) - len(after):] == after
        text = tok.decode(ids[len(before):len(ids) - len(after)])
        assert re.fullmatch(r"\d{4}=", text) and ids == template.encode(text, tok).tolist()

    # OPD and GRPO: every prompt batch row is its example's rendered prompt; the text stays raw
    for stage in ("opd", "grpo"):
        prompts = next(run.prompts(stage, 4))
        for tokens, valid, example in zip(prompts.tokens, prompts.valid, prompts.examples, strict=True):
            assert _valid_prompt(tokens, valid) == template.encode(example.prompt, tok).tolist()
            assert re.fullmatch(r"\d{4}=", example.prompt)
            assert run.reward(example, example.answer) == 1.0  # rewards read the example's text

    # evaluation: the held-out examples, batched as `evaluate` batches them
    examples = eval_examples(run)
    assert len(examples) == 6
    batches = prompt_dataset(examples, tok, run.config.canvas, seed=0, batch_size=6, shard_index=0,
                             shard_count=1, shuffle=False, num_epochs=1, drop_remainder=False)
    batch = batches[0]
    for tokens, valid, example in zip(batch.tokens, batch.valid, examples, strict=True):
        assert _valid_prompt(tokens, valid) == template.encode(example.prompt, tok).tolist()

    raw = Run(parse_pipeline_config(_preset(chat_template=False)))  # off: prompts are fed raw
    assert raw.chat_template is None
    example = raw.source("eval")[0]
    assert example.token_ids(raw.tokenizer)[0].tolist() == raw.tokenizer.encode(example.prompt).tolist()


def test_user_jsonl_prompts_are_rendered_and_counted(tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    rows.append({"prompt": "x" * 200, "completion": "0"})  # too long once rendered: skipped
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = Run(parse_pipeline_config(_preset(train_jsonl=str(data), eval_jsonl=str(data), overlong="skip")))
    tok, template = run.tokenizer, run.chat_template
    source = run.source("train")
    assert source.report.skipped_lines == (5,)
    expected = {tuple(template.encode(row["prompt"], tok).tolist()) for row in rows[:4]}
    batch = next(run.sft_batches("sft-student"))
    got = {tuple(_valid_prompt(t[:80], v[:80])) for t, v in zip(np.asarray(batch.layout.tokens),
                                                                 np.asarray(batch.layout.valid), strict=True)}
    assert got == expected
    prompts = next(run.prompts("grpo", 4))
    assert {tuple(_valid_prompt(t, v)) for t, v in zip(prompts.tokens, prompts.valid, strict=True)} == expected


def test_the_template_text_is_pinned_in_the_training_fingerprint(tmp_path):
    folder = tmp_path / "chatml"
    shutil.copytree(CHATML, folder)
    on = Run(parse_pipeline_config(_preset(folder)))
    off = Run(parse_pipeline_config(_preset(folder, chat_template=False)))
    assert "chat_template" not in off.training("grpo").fields  # runs without a template keep their fingerprint
    assert "chat_template" not in off.training("grpo").fields["task"]
    assert on.training("grpo").fields["chat_template"] == on.chat_template.digest
    file = tmp_path / "same.jinja"  # the same text from a file: the same training
    file.write_text(on.chat_template.source)
    assert Run(parse_pipeline_config(_preset(folder, chat_template=str(file)))).training("opd") == on.training("opd")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("Reply with the answer only.", "Be brief.")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    changed = Run(parse_pipeline_config(_preset(folder)))
    for stage in ("sft-student", "opd", "grpo"):
        with pytest.raises(FingerprintMismatch, match=r"chat_template"):
            require_compatible(on.training(stage), changed.training(stage))
    with pytest.raises(FingerprintMismatch, match=r"chat_template"):
        require_compatible(on.training("sft-teacher"), off.training("sft-teacher"))


def test_mistakes_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^task\.chat_template: the byte tokenizer has no chat template of its own"):
        parse_pipeline_config(_preset(None))
    with pytest.raises(ConfigError, match=r"^task\.chat_template: the tokenizer in '.*qwen3' has no chat template: "
                                          r"its tokenizer_config\.json has no chat_template"):
        parse_pipeline_config(_preset(FIXTURES / "qwen3"))
    with pytest.raises(ConfigError, match=r"^task\.chat_template: file '.*nope\.jinja' does not exist"):
        parse_pipeline_config(_preset(chat_template=str(tmp_path / "nope.jinja")))
    with pytest.raises(ConfigError, match=r"^task\.chat_template: expected bool or str, got 3"):
        parse_pipeline_config(_preset(chat_template=3))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(ConfigError, match=r"^task\.chat_template: .*bad\.jinja: not a valid Jinja template"):
        parse_pipeline_config(_preset(chat_template=str(bad)))
    # a byte tokenizer with a template file is fine; its markup is text
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    run = Run(parse_pipeline_config(_preset(None, chat_template=str(tmp_path / "t.jinja"))))
    example = run.source("train")[0]
    assert example.token_ids(run.tokenizer)[0].tolist() == run.tokenizer.encode(f"[{example.prompt}]").tolist()
    # before anything trains: a rendered prompt longer than the canvas's prompt, or a template that fails
    with pytest.raises(StageError, match=r"^canvas\.prompt_len: train problem 0 of task '\w+' \(.*\) takes 75 tokens "
                                         r"with the chat template's markup but canvas\.prompt_len = 64"):
        check_adopted(parse_pipeline_config(_preset(prompt_len=64)))
    failing = tmp_path / "fails.jinja"
    failing.write_text("{{ raise_exception('one turn only') }}")
    with pytest.raises(StageError, match=r"^task\.chat_template: .*fails\.jinja: rendering the prompt .* failed: "
                                         r"one turn only"):
        check_adopted(parse_pipeline_config(_preset(chat_template=str(failing))))


def test_an_export_carries_the_template(tmp_path):
    import jax

    from bd_models import BlockDiffusionLM
    from bd_train.stages import RunDir

    config = parse_pipeline_config({**_preset(), "run": {"output_dir": str(tmp_path)}})
    run = Run(config, RunDir.create(config, run_id="chat"))
    model = BlockDiffusionLM(run.model_config("student"), key=jax.random.key(0))
    folder = run.export(model, "sft-student", "student")
    exported = ChatTemplate.from_tokenizer(folder)
    assert exported.where.endswith("chat_template.jinja") and exported.source == run.chat_template.source
    released = json.loads((CHATML / "tokenizer_config.json").read_text())
    del released["chat_template"]  # in chat_template.jinja, as transformers writes it
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {
        **released, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "<|MASK|>"}
    assert released["tokenizer_class"] == "TokenizersBackend"  # the release's settings are kept


def test_an_export_without_a_template_keeps_the_releases_own(tmp_path):
    """Prompts fed raw: the export's tokenizer_config.json is the release's (its chat template
    included) with the run's mask and end-of-text tokens, and a release's chat_template.jinja is
    copied beside it. The export used to write only the two tokens, dropping the template."""
    import jax

    from bd_models import BlockDiffusionLM
    from bd_train.stages import RunDir

    for fixture in (CHATML, CHATML.parent / "llama3-chat"):
        config = parse_pipeline_config({**_preset(fixture, chat_template=False),
                                        "run": {"output_dir": str(tmp_path / fixture.name)}})
        run = Run(config, RunDir.create(config, run_id="raw"))
        model = BlockDiffusionLM(run.model_config("student"), key=jax.random.key(0))
        folder = run.export(model, "sft-student", "student")
        released = json.loads((fixture / "tokenizer_config.json").read_text())
        exported = json.loads((folder / "tokenizer_config.json").read_text())
        assert exported == {**released, "mask_token": run.tokenizer.token(run.tokenizer.mask_id),
                            "eos_token": run.tokenizer.token(run.tokenizer.eos_id)}
        assert ChatTemplate.from_tokenizer(folder).source == ChatTemplate.from_tokenizer(fixture).source
