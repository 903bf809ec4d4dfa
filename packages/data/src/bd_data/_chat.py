"""Chat templates: a prompt rendered as one user turn by a checkpoint's own Jinja template, as
transformers' `apply_chat_template(..., add_generation_prompt=True)` renders it, and encoded so
that the template's markup becomes special tokens while the prompt's text stays text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import numpy as np

from ._canvas import CanvasOverflow
from ._example import Example
from ._tokenizer import CONFIG_FILE, TokenizerError, special_tokens, tokenizer_config

TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints keep the template beside the tokenizer, not in its config


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, parsed or rendered; the message names the file."""


def _environment():
    # What transformers gives a template: a sandbox that cannot mutate its inputs, blocks trimmed as
    # in its own templates, loop controls, `{% generation %}` blocks, a `tojson` that leaves
    # non-ASCII and HTML characters alone, and the `raise_exception` / `strftime_now` globals.
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker marks the
        assistant's tokens with it for its masks): rendered as its body, which is all a prompt needs."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.cache
def _compiled(source: str):
    return _environment().from_string(source)


def _read_config(folder: Path) -> dict:
    try:
        return tokenizer_config(folder)
    except TokenizerError as err:
        raise ChatTemplateError(str(err)) from None


def _fences(text: str) -> tuple[str, str]:
    """Two private-use characters that `text` does not hold, to fence special-token text in a prompt."""
    free = (chr(c) for c in range(0xE000, 0xF8FF) if chr(c) not in text)
    return next(free), next(free)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (`source`), the special tokens it sees as variables (`bos_token`, ...)
    and where it came from (`where`, for messages). `digest` identifies the source text."""

    source: str
    variables: tuple[tuple[str, str], ...] = ()
    where: str = "chat template"

    def __post_init__(self):
        import jinja2

        try:
            _compiled(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{self.where}: not a valid Jinja template (line {err.lineno}: {err.message})"
                                    ) from None

    @classmethod
    def from_file(cls, path: str | Path, *, tokenizer_folder: str | Path | None = None) -> ChatTemplate:
        """The template in a Jinja file; the special tokens named by `tokenizer_folder`'s
        tokenizer_config.json (if any) are its variables."""
        path = Path(path)
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {str(path)!r} does not exist; give the path of a Jinja "
                                    f"template file")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ChatTemplateError(f"chat template file {str(path)!r} is not UTF-8 text") from None
        config = _read_config(Path(tokenizer_folder)) if tokenizer_folder is not None else {}
        return cls(source, tuple(special_tokens(config).items()), str(path))

    @classmethod
    def from_tokenizer(cls, folder: str | Path) -> ChatTemplate:
        """The tokenizer's own template: `chat_template.jinja` in `folder` if present (it wins, as
        in transformers), else `tokenizer_config.json`'s `chat_template` (a string, or a list of
        named templates of which `default` is used)."""
        folder = Path(folder)
        config = _read_config(folder)
        variables = tuple(special_tokens(config).items())
        if (folder / TEMPLATE_FILE).is_file():
            return cls.from_file(folder / TEMPLATE_FILE, tokenizer_folder=folder)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None and named:
                raise ChatTemplateError(
                    f"the tokenizer in {str(folder)!r} has named chat templates ({', '.join(map(str, named))}) but "
                    f"none named 'default', the one prompts use; write the one you want to a Jinja file and give "
                    f"its path as [task] chat_template")
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError(
                f"the tokenizer in {str(folder)!r} has no chat template: its {CONFIG_FILE} has no chat_template "
                f"and there is no {TEMPLATE_FILE} beside it; give the path of a Jinja template file instead")
        return cls(template, variables, str(folder / CONFIG_FILE))

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()[:16]

    def render(self, prompt: str) -> str:
        """The prompt as one user turn followed by the assistant's header."""
        import jinja2

        try:
            return _compiled(self.source).render(messages=[{"role": "user", "content": prompt}], tools=None,
                                                 documents=None, add_generation_prompt=True,
                                                 **dict(self.variables))
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.where}: rendering the prompt {prompt[:60]!r} failed: {err}") from None

    def encode(self, prompt: str, tokenizer) -> np.ndarray:
        """Token ids of the rendered prompt: special-token text the template writes becomes the
        special ids; the prompt stays text (special-token text in it is encoded as characters, as
        `tokenizer.encode` encodes data). A tokenizer without `encode_markup` (the byte tokenizer)
        encodes everything as text."""
        markup = getattr(tokenizer, "encode_markup", None)
        if markup is None:
            return np.asarray(tokenizer.encode(self.render(prompt)), np.int32)
        specials = tuple(sorted(tokenizer.special_texts, key=len, reverse=True))
        pattern = re.compile("|".join(map(re.escape, specials)) or "(?!)")
        if not pattern.search(prompt):  # the rendered text at once: exactly what transformers encodes
            return np.asarray(markup(self.render(prompt)), np.int32)
        # Fence each special-token text in the prompt, render, and encode the fenced pieces as text
        # and the rest as markup. A template that splits a fence pair leaves lone fences: dropped,
        # but they still cut the text, so its two sides cannot join into a special token.
        left, right = _fences(prompt + self.source + "".join(v for _, v in self.variables))
        rendered = self.render(pattern.sub(lambda m: left + m.group(0) + right, prompt))
        pieces = re.split(f"{left}({pattern.pattern}){right}", rendered)
        ids = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(tokenizer.encode(piece))
            else:
                ids.extend(markup(part) for part in re.split(f"[{left}{right}]", piece) if part)
        return np.concatenate([np.asarray(i, np.int32) for i in ids]) if ids else np.zeros(0, np.int32)

    def fit(self, prompt: str, tokenizer, max_tokens: int) -> np.ndarray:
        """The ids of the longest end of `prompt` whose rendering takes at most `max_tokens`: the
        template's markup is kept whole and the prompt is cut from its start (the text nearest the
        answer stays). `CanvasOverflow` if the markup alone is too long."""
        if len(ids := self.encode(prompt, tokenizer)) <= max_tokens:
            return ids
        if len(bare := self.encode("", tokenizer)) > max_tokens:
            raise CanvasOverflow(f"the chat template's markup alone takes {len(bare)} tokens but "
                                 f"CanvasConfig.prompt_len={max_tokens}; raise prompt_len")
        cut, kept = 0, len(prompt)  # the prompt from `cut` does not fit; from `kept` it does
        while kept - cut > 1:
            mid = (cut + kept) // 2
            if len(self.encode(prompt[mid:], tokenizer)) <= max_tokens:
                kept = mid
            else:
                cut = mid
        return self.encode(prompt[kept:], tokenizer)


def load_chat_template(spec: bool | str | Path | None, tokenizer_folder: str | Path | None) -> ChatTemplate | None:
    """None for `False`/None; the tokenizer's own template for `True` (the tokenizer folder must be
    given: the byte tokenizer has none); the Jinja file at a path otherwise."""
    if spec is None or spec is False:
        return None
    if spec is True:
        if tokenizer_folder is None:
            raise ChatTemplateError("the byte tokenizer has no chat template of its own; give the path of a Jinja "
                                    "template file (or use a tokenizer.json whose folder has one)")
        return ChatTemplate.from_tokenizer(tokenizer_folder)
    return ChatTemplate.from_file(spec, tokenizer_folder=tokenizer_folder)


@dataclasses.dataclass(frozen=True)
class ChatSource(Sequence):
    """`source`'s examples with their prompts rendered by `template` (`Example.prompt_ids`); the
    prompt text stays the example's, for rewards and display. An example that already carries
    prompt ids (`load_jsonl(..., canvas=...)`'s, raw or rendered) is refused: whether they are
    this template's cannot be told, and raw ones would be trained and sampled on silently. Give
    JSONL files their template with `load_jsonl(..., chat_template=...)`, which also fits the
    rendered prompts to the canvas."""

    source: Sequence[Example]
    template: ChatTemplate
    tokenizer: object

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Example:
        example = self.source[index]
        if example.prompt_ids is not None:
            raise ChatTemplateError(f"ChatSource: example {index} already carries prompt ids (load_jsonl with "
                                    f"canvas= encodes them); give the template to load_jsonl(..., chat_template=...) "
                                    f"instead of wrapping its source in ChatSource")
        return dataclasses.replace(example, prompt_ids=self.template.encode(example.prompt, self.tokenizer))
