"""Tokenizers behind one small protocol: a file-free byte tokenizer and a `tokenizer.json` adapter.

Both expose the special ids the canvas and sampler need (pad, mask, eos) and an `identity` string
that goes into model fingerprints, so a checkpoint cannot be reused with a different vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from bd_core import is_repo_id, resolve_pretrained


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks a special token the canvas needs."""


CONFIG_FILE = "tokenizer_config.json"
MAP_FILE = "special_tokens_map.json"
# The named special tokens of a tokenizer_config.json (transformers' `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_config(folder: str | Path) -> dict:
    """`folder`'s tokenizer_config.json as a dict (empty where the folder has none), with the
    special tokens of special_tokens_map.json merged in as transformers merges them: a config that
    lists its added tokens (`added_tokens_decoder`, what current transformers saves) is read
    alone; in an older one (without it), the map's tokens replace the config's."""
    config = _json_file(Path(folder) / CONFIG_FILE)
    if "added_tokens_decoder" in config:
        return config
    for name, value in _json_file(Path(folder) / MAP_FILE).items():
        if name in SPECIAL_TOKEN_NAMES:
            config[name] = value
    return config


def _json_file(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{file}: not valid JSON ({err}); restore it from the checkpoint, or delete it") from None
    return config if isinstance(config, dict) else {}


def special_tokens(config: dict) -> dict[str, str]:
    """The special tokens a tokenizer_config.json (`tokenizer_config`) names, by their names there
    (`mask_token`, `eos_token`, ...): each a string, or an object with `content`."""
    named = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            named[name] = value
    return named


@runtime_checkable
class Tokenizer(Protocol):
    """What bd_data needs from a tokenizer. `encode` adds no special tokens."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def mask_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def identity(self) -> str: ...
    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` (int32, no special tokens added)."""
        ...
    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """The text of `ids` without special tokens, cut at the first EOS unless `stop_at_eos=False`."""
        ...


def _utf8(text: str) -> bytes:
    """The text's UTF-8 bytes; text that has none (a lone surrogate, e.g. from a JSON `\\ud800`
    escape) is a `TokenizerError` naming the position."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TokenizerError(f"text has no UTF-8 form: {text[err.start:err.end]!r} at character {err.start} is a lone "
                             f"surrogate; fix the data (a JSON escape such as \\ud800 without its pair)") from None


def _cut(ids, eos_id: int, stop_at_eos: bool) -> list[int]:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if stop_at_eos and eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return ids


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then pad 256, mask 257, eos 258 (and bos 259 if asked).

    Decoding drops special ids, cuts at the first eos (text after a stop id is never part of a
    completion) and replaces invalid UTF-8, so any id sequence decodes without raising.
    """

    PAD, MASK, EOS, BOS = 256, 257, 258, 259

    def __init__(self, *, with_bos: bool = False):
        self.with_bos = bool(with_bos)

    # `@property` methods (not `property(lambda ...)`) so that type checkers see this class satisfy `Tokenizer`.
    @property
    def vocab_size(self) -> int:
        return 260 if self.with_bos else 259

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def mask_id(self) -> int:
        return self.MASK

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bos_id(self) -> int | None:
        return self.BOS if self.with_bos else None

    @property
    def identity(self) -> str:
        return "bytes-v1+bos" if self.with_bos else "bytes-v1"

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as ids 0–255."""
        return np.frombuffer(_utf8(text), dtype=np.uint8).astype(np.int32)

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """The text of the byte ids in `ids` (specials dropped, cut at the first EOS unless `stop_at_eos=False`)."""
        kept = bytes(i for i in _cut(ids, self.EOS, stop_at_eos) if 0 <= i < 256)
        return kept.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(with_bos={self.with_bos})"


class HFTokenizer:
    """A HF `tokenizer.json` (its path, a checkpoint folder that holds it, or a Hub repo id at
    `revision`); the identity carries a hash of the file's bytes.

    `mask_token` and `eos_token` must be in the vocabulary; `pad_token` falls back to the mask token
    when the file has none (padding is always marked invalid, so its id only has to be one that is
    never sampled: the eos token, which released tokenizers often use as pad, must stay samplable). A tokenizer
    without a mask token (an autoregressive checkpoint's) gets one with `add_mask_token=True`: a
    special token with the next free id (`vocab_size` grows by one; the model's embedding grows
    with it), recorded in the identity. `save` writes the tokenizer as used, added token included.
    """

    def __init__(self, path: str | Path, *, mask_token: str = "<|mask|>", eos_token: str = "<|endoftext|>",
                 pad_token: str | None = "<|pad|>", add_mask_token: bool = False, revision: str | None = None):
        from tokenizers import Tokenizer as _HF

        if is_repo_id(path) or revision is not None:  # a Hub repo id: its tokenizer.json from the Hub cache
            path = resolve_pretrained(path, revision).folder
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"tokenizer file {str(path)!r} does not exist; pass the path of a local tokenizer.json "
                f"(or use ByteTokenizer(), which needs no file)"
            )
        raw = path.read_bytes()
        try:
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises its own exception type for malformed files
            raise TokenizerError(f"tokenizer file {str(path)!r} is not a valid tokenizer.json: {err}") from err
        # Text is text: "<|endoftext|>" written in a data file is encoded as its characters, never as
        # the special id (special ids come only from the canvas).
        self._tok.encode_special_tokens = True
        self.path = path
        self._digest = hashlib.sha256(raw).hexdigest()[:16]
        self.added_mask = add_mask_token and self._tok.token_to_id(mask_token) is None
        if self.added_mask:
            self._tok.add_special_tokens([mask_token])
            self._digest += f"+{mask_token}"
        self._mask = self._require(mask_token, "mask_token", path)
        self._eos = self._require(eos_token, "eos_token", path)
        pad = self._tok.token_to_id(pad_token) if pad_token is not None else None
        self._pad = self._mask if pad is None else int(pad)

    def _require(self, token: str, field: str, path: Path) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"tokenizer file {str(path)!r} has no {field} {token!r}; pass {field}= ([tokenizer] {field} in a "
                f"preset) with a token it has"
                + (", or add_mask_token=True ([tokenizer] add_mask_token = true) to add it as a new special token "
                   "(the model's embedding grows by one row)" if field == "mask_token" else "")
            )
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def mask_id(self) -> int:
        return self._mask

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def identity(self) -> str:
        return f"hf-{self._digest}"

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` under `tokenizer.json` (no special tokens added)."""
        _utf8(text)
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    @functools.cached_property
    def _markup(self):
        # A second copy that matches special-token text: flipping `encode_special_tokens` on the
        # shared one would race with data encoded on other threads.
        from tokenizers import Tokenizer as _HF

        tok = _HF.from_str(self._tok.to_str())
        tok.encode_special_tokens = False
        return tok

    def encode_markup(self, text: str) -> np.ndarray:
        """Ids of markup a chat template wrote: special-token text becomes the special ids (which
        `encode` never does; data text stays text)."""
        _utf8(text)
        return np.asarray(self._markup.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special added token (what `encode_markup` turns into ids and `encode` does not)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def token(self, token_id: int) -> str | None:
        """The token text of an id (special tokens included)."""
        return self._tok.id_to_token(int(token_id))

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as used (an added mask token included) as a `tokenizer.json`."""
        self._tok.save(str(path))

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """The text of `ids` without pad, mask and EOS (cut at the first EOS unless `stop_at_eos=False`)."""
        specials = {self._pad, self._mask, self._eos}
        kept = [i for i in _cut(ids, self._eos, stop_at_eos) if i not in specials and 0 <= i < self.vocab_size]
        return self._tok.decode(kept, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, identity={self.identity!r})"
