"""Hub repo ids resolve through the Hub library's cache (offline here: a cache built from the
committed fixtures in its own layout) to the same weights as the folder; the revision picks the
snapshot, the resolved commit is reported, and a repo that is not cached offline is one line
naming it and how to fetch it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bd_core import ConfigError, HubError, is_repo_id, resolve_pretrained
from bd_data import HFTokenizer
from bd_models import from_pretrained, read_hf_config, save_pretrained

A, B = "a" * 40, "b" * 40
REPO = "bdlm-test/tiny-qwen3"


def test_a_repo_id_resolves_to_its_snapshot_and_commit(hub_cache):
    folder = hub_cache("qwen3", REPO, A, refs=("main", "v1"))
    source = resolve_pretrained(REPO)
    assert (source.folder, source.repo_id, source.revision, source.commit) == (folder, REPO, "main", A)
    assert resolve_pretrained(REPO, "v1").commit == A and resolve_pretrained(REPO, A).folder == folder
    assert source.to_dict() == {"repo_id": REPO, "revision": "main", "commit": A}
    local = resolve_pretrained(folder)
    assert local.folder == folder and local.repo_id is None and local.commit is None


def test_a_repo_id_reads_the_same_model_and_tokenizer_as_its_folder(hub_cache):
    folder = hub_cache("qwen3", REPO, A)
    hub_cache("qwen2", REPO, B, refs=("other",))
    assert read_hf_config(REPO) == read_hf_config(folder)
    assert read_hf_config(REPO, revision="other")["model_type"] == "qwen2"
    by_id, by_folder = from_pretrained(REPO, block_size=4), from_pretrained(folder, block_size=4)
    for got, want in zip(jax.tree.leaves(by_id), jax.tree.leaves(by_folder)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tok = HFTokenizer(REPO, mask_token="<|MASK|>")
    assert tok.identity == HFTokenizer(folder / "tokenizer.json", mask_token="<|MASK|>").identity


def test_an_export_records_its_source(hub_cache, tmp_path):
    hub_cache("qwen3", REPO, A)
    source = {"pretrained": resolve_pretrained(REPO).to_dict(), "stage": "sft-student"}
    out = save_pretrained(from_pretrained(REPO, block_size=4), tmp_path / "export", source=source)
    import json

    assert json.loads((out / "bdlm_source.json").read_text()) == source


def test_what_cannot_be_had_offline_is_one_line_naming_the_repo(hub_cache):
    hub_cache("qwen3", REPO, A)
    with pytest.raises(HubError) as err:
        resolve_pretrained("bdlm-test/absent")
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "bdlm-test/absent" in message and "HF_HUB_OFFLINE" in message
    assert "hf download bdlm-test/absent" in message
    with pytest.raises(HubError, match="revision 'v9'"):
        resolve_pretrained(REPO, "v9")
    # The repo is cached, at another revision: said so, with what the cache holds (it was "the
    # Hub repo is not in the Hub cache"); offline, a short commit is not resolved.
    for revision in ("v9", "aaaaaaa"):
        with pytest.raises(HubError, match=rf"at revision '{revision}': the Hub cache holds this repo but not at "
                                           rf"that revision while HF_HUB_OFFLINE is set; it holds main, {A}\."):
            resolve_pretrained(REPO, revision)
    with pytest.raises(HubError, match="is a local folder, not a Hub repo id"):
        resolve_pretrained(str(hub_cache("qwen2", "bdlm-test/other", B)), "main")


def test_what_counts_as_a_repo_id(tmp_path):
    assert is_repo_id("JetLM/SDAR-1.7B-Chat") and is_repo_id("Qwen/Qwen3-0.6B")
    assert not is_repo_id(str(tmp_path)) and not is_repo_id("./a/b") and not is_repo_id("a/b/c")
    assert not is_repo_id("data/tokenizer.json") and not is_repo_id("name")


def test_a_plan_reads_a_repos_config_and_tokenizer_without_its_weights(hub_cache):
    """An ahead-of-time plan fetches a repo's config and tokenizer only (`weights=False`, as
    `bd_train.plan` resolves every `pretrained` it reads); a snapshot without the weights is then
    enough for it, and for training it is one line naming the repo and the download."""
    from bd_train.stages import parse_pipeline_config, pipeline_config, shapes_only

    repo = "bdlm-test/tiny-sdar"
    hub_cache("sdar", repo, A, weights=False)
    source = resolve_pretrained(repo, weights=False)
    assert source.commit == A and (source.folder / "config.json").is_file()
    assert not list(source.folder.glob("*.safetensors"))
    with pytest.raises(HubError) as err:
        resolve_pretrained(repo)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "model-00001-of-00004.safetensors" in message
    assert f"hf download {repo}" in message

    preset = {"teacher": {"pretrained": repo}, "student": {"pretrained": repo}}
    with shapes_only():
        config = pipeline_config(parse_pipeline_config(preset))
        assert config.student.source is not None and config.student.source.commit == A
    with pytest.raises(ConfigError, match=r"(teacher|student)\.pretrained: .*lacks some of the model's files"):
        parse_pipeline_config(preset)
