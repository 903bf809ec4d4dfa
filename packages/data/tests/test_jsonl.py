"""JSONL loading: every error names file and line; the over-long policy is applied and reported."""

import re

import pytest

from bd_data import ByteTokenizer, CanvasConfig, JsonlError, load_jsonl, sft_dataset

TOK = ByteTokenizer()
CANVAS = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
GOOD = b'{"prompt": "2+2=", "completion": "4"}\n'


def _write(tmp_path, *lines: bytes, name="data.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join(lines))
    return path


@pytest.mark.parametrize("bad, message", [
    (b'{"prompt": "a", "completion": \n', r"invalid JSON \(Expecting value at column"),
    (b'["prompt", "completion"]\n', r"expected a JSON object with fields \['prompt', 'completion'\], got list"),
    (b'{"prompt": "a"}\n', r"missing field 'completion'"),
    (b'{"completion": "a"}\n', r"missing field 'prompt'"),
    (b'{"prompt": "a", "completion": 5}\n', r"field 'completion' must be a string, got int"),
    (b'{"prompt": "  ", "completion": "x"}\n', r"field 'prompt' is empty"),
    (b'{"prompt": "a", "completion": ""}\n', r"field 'completion' is empty"),
    (b'{"prompt": "\xff\xfe", "completion": "x"}\n', r"not valid UTF-8 \(byte 12 of the line\)"),
    (b'[' * 100_000 + b"\n", r"invalid JSON"),
    (b'{"prompt": "a", "completion": "x", "n": ' + b"9" * 5000 + b"}\n", r"invalid JSON \(Exceeds the limit"),
])
def test_each_error_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, GOOD, b"\n", bad, GOOD)
    with pytest.raises(JsonlError, match=rf"^{re.escape(str(path))}:3: {message}"):
        load_jsonl(path)


def test_a_byte_order_mark_is_read_past(tmp_path):
    """Some editors save UTF-8 with a byte-order mark: its first line was refused as invalid JSON."""
    data = load_jsonl(_write(tmp_path, "\ufeff".encode() + GOOD, GOOD))
    assert len(data) == 2 and data[0].prompt == "2+2="


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(JsonlError, match=r"nope\.jsonl: no such file"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(JsonlError, match=r"empty\.jsonl: no records \(the file is empty or holds blank lines only\)"):
        load_jsonl(_write(tmp_path, b"\n\n", name="empty.jsonl"))
    with pytest.raises(JsonlError, match=r"data: is a folder; pass the path of a JSONL file"):
        (tmp_path / "data").mkdir()
        load_jsonl(tmp_path / "data")


def test_overlong_policies(tmp_path):
    long_prompt = b'{"prompt": "123456789+1=", "completion": "x"}\n'
    long_answer = b'{"prompt": "q=", "completion": "abcdefghij"}\n'
    path = _write(tmp_path, GOOD, long_prompt, GOOD, long_answer)
    with pytest.raises(JsonlError, match=rf"^{re.escape(str(path))}:2: prompt has 12 tokens but "
                                         r"CanvasConfig.prompt_len=8.*'truncate'"):
        load_jsonl(path, tokenizer=TOK, canvas=CANVAS)

    skipped = load_jsonl(path, tokenizer=TOK, canvas=CANVAS, overlong="skip")
    assert len(skipped) == 2 and skipped.lines == (1, 3)
    assert skipped.report.skipped_lines == (2, 4) and skipped.report.truncated == 0
    assert "2 skipped" in skipped.report.summary()

    cut = load_jsonl(path, tokenizer=TOK, canvas=CANVAS, overlong="truncate")
    assert len(cut) == 4 and cut.report.truncated_lines == (2, 4) and cut.report.skipped == 0
    assert TOK.decode(cut[1].prompt_ids) == "56789+1=" and TOK.decode(cut[3].answer_ids) == "abcdefg"
    assert [ex.index for ex in cut] == [0, 1, 2, 3]
    # Truncated examples flow through the pipeline (the stored ids are used, not the text).
    batch = sft_dataset(cut, TOK, CANVAS, seed=0, batch_size=4, shard_index=0, shard_count=1, shuffle=False)[0]
    assert batch.layout.shape == (4, 8 + 16)

    with pytest.raises(ValueError, match="needs tokenizer= and canvas="):
        load_jsonl(path, overlong="skip")
    with pytest.raises(ValueError, match="overlong: expected one of"):
        load_jsonl(path, tokenizer=TOK, canvas=CANVAS, overlong="drop")


@pytest.mark.parametrize("with_canvas", [True, False])
def test_a_lone_surrogate_is_refused_naming_file_line_and_field(tmp_path, with_canvas):
    """Python's json accepts "\\ud800"; the tokenizer used to fail on it later with no file or line."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "12=", "completion": "3"}\n{"prompt": "4\\ud800=", "completion": "1"}\n')
    kwargs = dict(tokenizer=ByteTokenizer(), canvas=CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)) \
        if with_canvas else {}
    with pytest.raises(JsonlError, match=rf"{path}:2: field 'prompt' holds '\\ud800' at character 1"):
        load_jsonl(path, **kwargs)
