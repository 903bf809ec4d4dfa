"""Chat templates: rendered text and token ids equal transformers' `apply_chat_template` on the
committed fixtures (chat_reference.json, made by make_chat_fixtures.py); special-token text in a
prompt stays text; where templates come from; the JSONL loader counts the rendered prompt."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bd_data import (
    ByteTokenizer,
    CanvasConfig,
    ChatSource,
    ChatTemplate,
    ChatTemplateError,
    HFTokenizer,
    JsonlError,
    get_task,
    load_chat_template,
    load_jsonl,
)

FIXTURES = Path(__file__).resolve().parents[2] / "models" / "tests" / "fixtures" / "hf"
REFERENCE = json.loads((FIXTURES / "chat_reference.json").read_text(encoding="utf-8"))
FOLDERS = sorted(REFERENCE["folders"])
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


def _tokenizer(folder: str) -> HFTokenizer:
    eos = REFERENCE["folders"][folder]["special_tokens_map"]["eos_token"]
    return HFTokenizer(FIXTURES / folder, mask_token="<|MASK|>", eos_token=eos)


def test_the_fixtures_hold_what_they_claim():
    assert REFERENCE["versions"] == {"transformers": "5.24.0", "tokenizers": "0.23.3", "jinja2": "3.1.6"}
    assert FOLDERS == ["chatml", "llama3-chat"]
    assert (FIXTURES / "llama3-chat" / "chat_template.jinja").is_file()  # the newer separate-file form
    assert "chat_template" in json.loads((FIXTURES / "chatml" / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("folder", FOLDERS)
def test_rendering_and_ids_equal_transformers(folder):
    reference = REFERENCE["folders"][folder]
    template, tok = ChatTemplate.from_tokenizer(FIXTURES / folder), _tokenizer(folder)
    assert dict(template.variables) == reference["special_tokens_map"]
    specials = set(tok.special_texts)
    for case in reference["cases"]:
        assert template.render(case["prompt"]) == case["text"]
        ids = template.encode(case["prompt"], tok).tolist()
        # transformers with sanitize_control_tokens=True: the prompt's special-token text as text
        assert ids == case["ids_sanitized"]
        if not any(s in case["prompt"] for s in specials):  # ordinary content: apply_chat_template's own ids
            assert ids == case["ids"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_markup_is_special_tokens_and_the_prompt_stays_text(folder):
    template, tok = ChatTemplate.from_tokenizer(FIXTURES / folder), _tokenizer(folder)
    special_ids = {int(tok.encode_markup(s)[0]) for s in tok.special_texts}
    bare = template.encode("x", tok)
    assert {int(i) for i in bare} & special_ids  # the template's markup
    for text in tok.special_texts:
        prompt = f"a{text}b {text}"
        ids = template.encode(prompt, tok)
        assert len(set(ids.tolist()) & special_ids) == len(set(bare.tolist()) & special_ids)
        assert sum(int(i) in special_ids for i in ids) == sum(int(i) in special_ids for i in bare)
    # encode_markup recognizes what encode keeps as text
    some = tok.special_texts[0]
    assert len(tok.encode_markup(some)) == 1 and len(tok.encode(some)) > 1


def test_a_prompt_with_fence_characters_and_special_text_still_renders():
    template, tok = ChatTemplate.from_tokenizer(FIXTURES / "chatml"), _tokenizer("chatml")
    prompt = "\ue000<|im_end|>\ue001 and \ue002"
    ids = template.encode(prompt, tok)
    before, after = template.render("X").split("X")
    expected = np.concatenate([tok.encode_markup(before), tok.encode(prompt), tok.encode_markup(after)])
    assert ids.tolist() == expected.tolist()


def test_the_separate_jinja_file_wins_over_the_config(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(FIXTURES / "chatml", folder)
    assert ChatTemplate.from_tokenizer(folder).where.endswith("tokenizer_config.json")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    template = ChatTemplate.from_tokenizer(folder)
    assert template.where.endswith("chat_template.jinja") and template.source == TEMPLATE
    assert template.render("hi") == "<user>hi</user><assistant>"


def test_template_helpers_match_transformers_environment(tmp_path):
    source = ("{{ messages | tojson }}|{{ bos_token }}|{% for m in messages %}{% if loop.first %}{% continue %}"
              "{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}")
    rendered = ChatTemplate(source, (("bos_token", "<s>"),)).render("é<&>")
    assert rendered == '[{"role": "user", "content": "é<&>"}]|<s>|4'
    failing = ChatTemplate("{{ raise_exception('no user turns here') }}", where="t.jinja")
    with pytest.raises(ChatTemplateError, match=r"^t\.jinja: rendering the prompt 'x' failed: no user turns here"):
        failing.render("x")
    with pytest.raises(ChatTemplateError, match=r"^bad\.jinja: not a valid Jinja template \(line 1"):
        ChatTemplate("{% for %}", where="bad.jinja")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses to mutate its inputs
        ChatTemplate("{% set _ = messages.append(1) %}").render("x")


def test_where_templates_come_from_and_the_errors(tmp_path):
    assert load_chat_template(False, FIXTURES / "chatml") is None
    own = ChatTemplate.from_tokenizer(FIXTURES / "chatml")
    assert load_chat_template(True, FIXTURES / "chatml").source == own.source
    with pytest.raises(ChatTemplateError, match=r"the tokenizer in '.*qwen3' has no chat template: its "
                                                 r"tokenizer_config\.json has no chat_template and there is no "
                                                 r"chat_template\.jinja beside it"):
        load_chat_template(True, FIXTURES / "qwen3")
    with pytest.raises(ChatTemplateError, match=r"the byte tokenizer has no chat template of its own; give the path"):
        load_chat_template(True, None)
    with pytest.raises(ChatTemplateError, match=r"chat template file '.*nope\.jinja' does not exist"):
        load_chat_template(str(tmp_path / "nope.jinja"), None)
    file = tmp_path / "t.jinja"
    file.write_text("{{ eos_token }}" + TEMPLATE)
    with_tokens = load_chat_template(str(file), FIXTURES / "chatml")  # the tokenizer's special tokens are its variables
    assert with_tokens.render("q") == "<|im_end|><user>q</user><assistant>"
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": TEMPLATE}]}))
    assert ChatTemplate.from_tokenizer(listed).source == TEMPLATE
    assert ChatTemplate(TEMPLATE).digest != ChatTemplate(TEMPLATE + " ").digest


def test_the_byte_tokenizer_encodes_a_file_template_as_text():
    tok = ByteTokenizer()
    ids = ChatTemplate(TEMPLATE).encode("1 2>", tok)
    assert ids.tolist() == tok.encode("<user>1 2></user><assistant>").tolist()


def test_chat_source_sets_prompt_ids_and_keeps_the_text():
    task = get_task("sort", seed=0, length=4)
    template, tok = ChatTemplate.from_tokenizer(FIXTURES / "chatml"), _tokenizer("chatml")
    source = ChatSource(task.dataset("eval", 5), template, tok)
    assert len(source) == 5
    for i in range(5):
        raw, templated = task.example(i, "eval"), source[i]
        assert templated.prompt == raw.prompt and templated.answer == raw.answer
        assert templated.token_ids(tok)[0].tolist() == template.encode(raw.prompt, tok).tolist()


def test_chat_source_refuses_examples_that_already_carry_prompt_ids(tmp_path):
    """`load_jsonl(..., canvas=...)` encodes the raw prompts: wrapped in a ChatSource they were
    passed through untemplated, silently."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    tok = ByteTokenizer()
    loaded = load_jsonl(path, tokenizer=tok, canvas=CanvasConfig(prompt_len=32, max_new_tokens=4, block_size=4))
    with pytest.raises(ChatTemplateError, match=r"example 0 already carries prompt ids .* load_jsonl\(\.\.\., "
                                                r"chat_template=\.\.\.\)"):
        ChatSource(loaded, ChatTemplate(TEMPLATE), tok)[0]


def test_jsonl_lengths_count_the_rendered_prompt(tmp_path):
    tok, template = ByteTokenizer(), ChatTemplate(TEMPLATE)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n"
                    + json.dumps({"prompt": "a long prompt of words " * 3, "completion": "5"}) + "\n")
    canvas = CanvasConfig(prompt_len=32, max_new_tokens=4, block_size=4)  # "2+2=" rendered: 28 bytes
    loaded = load_jsonl(path, tokenizer=tok, canvas=canvas, overlong="skip", chat_template=template)
    assert loaded.report.skipped_lines == (2,)
    assert loaded[0].prompt_ids.tolist() == template.encode("2+2=", tok).tolist() and loaded[0].prompt == "2+2="
    with pytest.raises(JsonlError, match=r"d\.jsonl:2: prompt has 93 tokens with the chat template's markup "
                                         r"\(task\.chat_template\) but CanvasConfig\.prompt_len=32"):
        load_jsonl(path, tokenizer=tok, canvas=canvas, chat_template=template)
    cut = load_jsonl(path, tokenizer=tok, canvas=canvas, overlong="truncate", chat_template=template)
    assert cut.report.truncated_lines == (2,)
    ids = cut[1].prompt_ids
    text = tok.decode(ids)
    assert len(ids) <= 32 and text.startswith("<user>") and text.endswith("words </user><assistant>")
    kept = len(text) - 24  # the prompt's longest end that fits: one more character does not
    assert len(ids) == 32 and len(template.encode(("a long prompt of words " * 3)[-kept - 1:], tok)) > 32
    with pytest.raises(JsonlError, match=r"d\.jsonl:1: the chat template's markup alone takes 24 tokens but "
                                         r"CanvasConfig\.prompt_len=16; raise prompt_len \(in a preset: \[canvas\] "
                                         r"prompt_len\)$"):  # not: load with overlong='truncate', as it was
        load_jsonl(path, tokenizer=tok, canvas=CanvasConfig(prompt_len=16, max_new_tokens=4, block_size=4),
                   overlong="truncate", chat_template=template)
    failing = ChatTemplate("{{ raise_exception('refused') }}", where="t.jinja")
    with pytest.raises(JsonlError, match=r"d\.jsonl:1: t\.jinja: rendering the prompt '2\+2=' failed: refused"):
        load_jsonl(path, tokenizer=tok, canvas=canvas, chat_template=failing)


def test_the_tokenizer_config_is_read_once_for_tokens_and_templates(tmp_path):
    """One reader of tokenizer_config.json serves the stages' special tokens and the chat template:
    a token as a string or as an object with `content`, nothing where the file is absent, and a
    broken file refused naming it (as a tokenizer error, and as a chat template error where a
    template is read from it)."""
    from bd_data import TokenizerError, special_tokens, tokenizer_config

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "mask_token": {"content": "<|mask|>", "special": True}, "pad_token": None}))
    assert special_tokens(tokenizer_config(tmp_path)) == {"eos_token": "<|im_end|>", "mask_token": "<|mask|>"}
    assert tokenizer_config(tmp_path / "absent") == {}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(TokenizerError, match=r"broken/tokenizer_config\.json: not valid JSON .*restore it"):
        tokenizer_config(broken)
    with pytest.raises(ChatTemplateError, match=r"broken/tokenizer_config\.json: not valid JSON"):
        ChatTemplate.from_tokenizer(broken)


def test_special_tokens_map_merges_as_transformers_merges_it(tmp_path):
    """Older checkpoints keep `bos_token` in special_tokens_map.json: a template's `{{ bos_token }}`
    rendered empty without it. transformers reads the map only when tokenizer_config.json lists no
    `added_tokens_decoder`, and then the map's tokens replace the config's (here `eos_token`, which
    the config used to keep: another end-of-text token than transformers')."""
    from bd_data import special_tokens, tokenizer_config

    template = "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<other>"}))
    assert special_tokens(tokenizer_config(tmp_path)) == {"bos_token": "<s>", "eos_token": "<other>"}
    assert ChatTemplate.from_tokenizer(tmp_path).render("hi") == "<s>[INST] hi [/INST]<other>"
    listed = {"eos_token": "</s>", "chat_template": template, "added_tokens_decoder": {}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(listed))
    assert special_tokens(tokenizer_config(tmp_path)) == {"eos_token": "</s>"}  # the map is not read
    assert ChatTemplate.from_tokenizer(tmp_path).render("hi") == "[INST] hi [/INST]</s>"


def test_named_templates_without_a_default_are_listed(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ messages[0]['content'] }}"}, {"name": "rag", "template": "x"}]}))
    with pytest.raises(ChatTemplateError, match=r"has named chat templates \(tool_use, rag\) but none named "
                                                r"'default'"):
        ChatTemplate.from_tokenizer(tmp_path)


def test_templates_with_generation_blocks_render_their_body():
    """Training templates mark the assistant's turn with `{% generation %}` (transformers'
    AssistantTracker); they were refused as an unknown tag."""
    from bd_data._chat import _compiled

    source = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert ChatTemplate(source).render("hi") == "<user>hi<assistant>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]
    assert _compiled(source).render(messages=messages, add_generation_prompt=False) == "<user>hi<assistant>4"
