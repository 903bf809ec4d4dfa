"""User data from JSONL: one `{"prompt": ..., "completion": ...}` object per line.

Every error names the file and the line (`read_records` reads other field sets the same way).
Over-long examples (measured with the tokenizer against the canvas, the prompt as a chat template
renders it when one is given) raise by default; `truncate` and `skip` are counted and reported.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._canvas import OVERLONG_POLICIES, CanvasConfig, CanvasOverflow, fit_to_canvas
from ._chat import ChatTemplate, ChatTemplateError
from ._example import Example
from ._tokenizer import Tokenizer

FIELDS = ("prompt", "completion")


class JsonlError(ValueError):
    """A JSONL record that cannot be used; the message starts with `file:line:`."""


@dataclasses.dataclass(frozen=True)
class OverlongReport:
    """What the over-long policy did: line numbers (1-based) truncated or skipped."""

    policy: str
    truncated_lines: tuple[int, ...] = ()
    skipped_lines: tuple[int, ...] = ()

    @property
    def truncated(self) -> int:
        return len(self.truncated_lines)

    @property
    def skipped(self) -> int:
        return len(self.skipped_lines)

    def summary(self) -> str:
        """One line: the over-long policy and how many examples it truncated or skipped."""
        return f"over-long policy {self.policy!r}: {self.truncated} truncated, {self.skipped} skipped"


@dataclasses.dataclass(frozen=True)
class JsonlSource(Sequence):
    """The loaded examples (a grain `MapDataset` source), their line numbers and the report."""

    path: Path
    examples: tuple[Example, ...]
    lines: tuple[int, ...]
    report: OverlongReport

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]


def _record(path: Path, number: int, raw: bytes, fields: tuple[str, ...]) -> tuple[str, ...] | None:
    where = f"{path}:{number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonlError(
            f"{where}: not valid UTF-8 (byte {err.start} of the line); re-encode the file as UTF-8") from None
    if number == 1 and line.startswith("\ufeff"):  # a byte-order mark, as some editors save UTF-8
        line = line[1:]
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise JsonlError(
            f"{where}: invalid JSON ({err.msg} at column {err.colno}); each line must be one JSON object") from None
    except RecursionError:
        raise JsonlError(f"{where}: invalid JSON (nested too deeply); each line must be one flat JSON object") from None
    except ValueError as err:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise JsonlError(f"{where}: invalid JSON ({err}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise JsonlError(f"{where}: expected a JSON object with fields {list(fields)}, got {type(record).__name__}")
    values = []
    for field in fields:
        if field not in record:
            raise JsonlError(f"{where}: missing field {field!r}; every record needs {list(fields)}")
        value = record[field]
        if not isinstance(value, str):
            raise JsonlError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise JsonlError(f"{where}: field {field!r} is empty; remove the record or give it text")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON accepts a lone surrogate escape such as "\ud800"
            raise JsonlError(f"{where}: field {field!r} holds {value[err.start:err.end]!r} at character {err.start}, "
                             "a lone surrogate with no UTF-8 form; fix the escape (or remove the record)") from None
        values.append(value)
    return tuple(values)


def read_records(path: Path, fields: tuple[str, ...] = FIELDS) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(line number, the string `fields`) of each non-blank line; errors name the file and line."""
    if path.is_dir():
        raise JsonlError(f"{path}: is a folder; pass the path of a JSONL file with {list(fields)} per line")
    if not path.is_file():
        raise JsonlError(f"{path}: no such file; pass the path of a JSONL file with {list(fields)} per line")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            record = _record(path, number, raw.rstrip(b"\r\n"), fields)
            if record is not None:
                yield number, record


def _fit(prompt: str, completion: str, tokenizer: Tokenizer, canvas: CanvasConfig, overlong: str,
         chat_template: ChatTemplate | None):
    """`fit_to_canvas` on the prompt as the template renders it; `truncate` cuts the prompt's
    text inside the template (its markup stays whole)."""
    answer = tokenizer.encode(completion)
    if chat_template is None:
        return fit_to_canvas(tokenizer.encode(prompt), answer, canvas, overlong)
    prompt_ids, cut = chat_template.encode(prompt, tokenizer), False
    if len(prompt_ids) > canvas.prompt_len and overlong == "error":
        raise CanvasOverflow(f"prompt has {len(prompt_ids)} tokens with the chat template's markup "
                             f"(task.chat_template) but CanvasConfig.prompt_len={canvas.prompt_len}; raise prompt_len "
                             f"or shorten the prompt")
    if len(prompt_ids) > canvas.prompt_len and overlong == "truncate":
        prompt_ids, cut = chat_template.fit(prompt, tokenizer, canvas.prompt_len), True
    fitted = fit_to_canvas(prompt_ids, answer, canvas, overlong)
    return None if fitted is None else (fitted[0], fitted[1], fitted[2] or cut)


def load_jsonl(path: str | Path, *, tokenizer: Tokenizer | None = None, canvas: CanvasConfig | None = None,
               overlong: str = "error", chat_template: ChatTemplate | None = None) -> JsonlSource:
    """Load and check every record; with `tokenizer` and `canvas`, apply the over-long policy
    (`error`, `truncate` or `skip`) and keep the token ids of each example. With `chat_template`
    (which needs both), the prompt ids are the rendered prompt's, and lengths count them."""
    path = Path(path)
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"load_jsonl overlong: expected one of {OVERLONG_POLICIES}, got {overlong!r}")
    if (tokenizer is None) != (canvas is None):
        raise ValueError("load_jsonl: pass both tokenizer= and canvas= (to check lengths) or neither")
    if overlong != "error" and canvas is None:
        raise ValueError(f"load_jsonl overlong={overlong!r} needs tokenizer= and canvas= to measure lengths")
    if chat_template is not None and canvas is None:
        raise ValueError("load_jsonl chat_template= needs tokenizer= and canvas= (the rendered prompt must fit)")
    examples, lines, truncated, skipped = [], [], [], []
    for number, (prompt, completion) in read_records(path):
        prompt_ids = answer_ids = None
        if canvas is not None:
            assert tokenizer is not None  # checked above: tokenizer= and canvas= come together
            try:
                fitted = _fit(prompt, completion, tokenizer, canvas, overlong, chat_template)
            except CanvasOverflow as err:
                hint = ("; or load with overlong='truncate' or 'skip' (in a preset: [canvas] prompt_len / "
                        "max_new_tokens, or [task] overlong)") if overlong == "error" else \
                    " (in a preset: [canvas] prompt_len)"
                raise JsonlError(f"{path}:{number}: {err}{hint}") from None
            except ChatTemplateError as err:
                raise JsonlError(f"{path}:{number}: {err}") from None
            if fitted is None:
                skipped.append(number)
                continue
            prompt_ids, answer_ids, was_truncated = fitted
            if was_truncated:
                truncated.append(number)
        examples.append(Example(prompt, completion, len(examples), prompt_ids, answer_ids))
        lines.append(number)
    if not examples and not skipped:
        raise JsonlError(f"{path}: no records (the file is empty or holds blank lines only); it needs at least one "
                         f"JSON object per line")
    if not examples:
        raise JsonlError(
            f"{path}: no usable records ({len(skipped)} skipped as over-long); the file needs at least one")
    return JsonlSource(path, tuple(examples), tuple(lines), OverlongReport(overlong, tuple(truncated), tuple(skipped)))
