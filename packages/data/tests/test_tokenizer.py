"""Tokenizers: byte round-trip, special ids, and the tokenizer.json adapter with its errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bd_data import ByteTokenizer, HFTokenizer, TokenizerError


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max(initial=0) < 256
    assert tok.decode(ids) == text


def test_byte_specials_and_decode_rules():
    tok, with_bos = ByteTokenizer(), ByteTokenizer(with_bos=True)
    assert (tok.vocab_size, with_bos.vocab_size) == (259, 260)
    assert len({tok.pad_id, tok.mask_id, tok.eos_id}) == 3 and min(tok.pad_id, tok.mask_id, tok.eos_id) >= 256
    assert tok.identity == "bytes-v1" and with_bos.identity != tok.identity
    ids = np.concatenate([tok.encode("12"), [tok.mask_id, tok.pad_id], tok.encode("3"), [tok.eos_id], tok.encode("9")])
    assert tok.decode(ids) == "123"  # specials dropped, text after eos cut
    assert tok.decode(ids, stop_at_eos=False) == "1239"
    assert tok.decode([0xFF, 0xFE]) == "\ufffd\ufffd"  # invalid UTF-8 never raises


def _write_tokenizer(path, specials):
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox 123+456=579", "sort 315926= 123569"] * 20, trainer)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def test_hf_adapter_round_trip_and_identity(tmp_path):
    path = tmp_path / "tokenizer.json"
    _write_tokenizer(path, ["<|pad|>", "<|mask|>", "<|endoftext|>"])
    tok = HFTokenizer(path)
    for text in ["the quick brown fox", "123+456=579", "unseen wörds ✓"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size > max(tok.pad_id, tok.mask_id, tok.eos_id)
    assert tok.decode(np.concatenate([tok.encode("fox"), [tok.eos_id], tok.encode("tail")])) == "fox"
    assert tok.identity.startswith("hf-")
    other = tmp_path / "other.json"
    _write_tokenizer(other, ["<|pad|>", "<|mask|>", "<|endoftext|>", "<|extra|>"])
    assert HFTokenizer(other).identity != tok.identity
    assert HFTokenizer(path).identity == tok.identity


def test_hf_adapter_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"missing\.json.*does not exist.*ByteTokenizer"):
        HFTokenizer(tmp_path / "missing.json")
    path = tmp_path / "nomask.json"
    _write_tokenizer(path, ["<|pad|>", "<|endoftext|>"])
    with pytest.raises(TokenizerError, match=r"nomask\.json.*no mask_token '<\|mask\|>'.*add_mask_token=True"):
        HFTokenizer(path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"bad\.json.*not a valid tokenizer\.json"):
        HFTokenizer(bad)


def test_added_mask_token_takes_the_next_id_and_is_recorded(tmp_path):
    path = tmp_path / "nomask.json"
    _write_tokenizer(path, ["<|pad|>", "<|endoftext|>"])
    plain = HFTokenizer(path, mask_token="<|endoftext|>")
    tok = HFTokenizer(path, add_mask_token=True)
    assert tok.added_mask and tok.mask_id == plain.vocab_size and tok.vocab_size == plain.vocab_size + 1
    assert tok.identity != plain.identity and tok.identity.endswith("+<|mask|>")
    assert tok.decode([*tok.encode("fox"), tok.mask_id]) == "fox"
    assert list(tok.encode("<|mask|>")) != [tok.mask_id]  # text is text, even for the added token
    tok.save(tmp_path / "saved.json")
    again = HFTokenizer(tmp_path / "saved.json")
    assert (again.mask_id, again.vocab_size, again.added_mask) == (tok.mask_id, tok.vocab_size, False)
    has_mask = tmp_path / "mask.json"
    _write_tokenizer(has_mask, ["<|pad|>", "<|mask|>", "<|endoftext|>"])
    assert not HFTokenizer(has_mask, add_mask_token=True).added_mask  # nothing to add


def test_hf_pad_falls_back_to_the_never_sampled_mask(tmp_path):
    path = tmp_path / "nopad.json"
    _write_tokenizer(path, ["<|mask|>", "<|endoftext|>"])
    tok = HFTokenizer(path)
    assert tok.pad_id == tok.mask_id != tok.eos_id


def test_text_never_becomes_control_tokens(tmp_path):
    """Special-token text in user data used to come back as the special ids ("<|mask|>" -> [mask_id])."""
    path = tmp_path / "tokenizer.json"
    _write_tokenizer(path, ["<|pad|>", "<|mask|>", "<|endoftext|>"])
    tok = HFTokenizer(path)
    for text in ("a<|endoftext|>b", "<|mask|>", "<|pad|>1"):
        ids = tok.encode(text).tolist()
        assert not {tok.eos_id, tok.mask_id, tok.pad_id} & set(ids), (text, ids)
        assert tok.decode(ids) == text
    byte = ByteTokenizer()
    assert not {byte.eos_id, byte.mask_id, byte.pad_id} & set(byte.encode("a<|endoftext|>b").tolist())


@pytest.mark.parametrize("make", [ByteTokenizer, "hf"])
def test_a_lone_surrogate_is_a_tokenizer_error_naming_where(tmp_path, make):
    if make == "hf":
        path = tmp_path / "tokenizer.json"
        _write_tokenizer(path, ["<|pad|>", "<|mask|>", "<|endoftext|>"])
        tok = HFTokenizer(path)
    else:
        tok = make()
    with pytest.raises(TokenizerError, match=r"'\\ud800' at character 1 is a lone surrogate"):
        tok.encode("4\ud800=")
