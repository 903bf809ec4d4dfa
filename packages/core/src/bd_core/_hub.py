"""Where a released checkpoint's files are: a local folder, or a Hugging Face Hub repo id resolved
through `huggingface_hub` (its standard cache, `HF_HOME`/`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, tokens
as the Hub library reads them) to a snapshot folder and the commit it holds.

Only the files a model needs are fetched: `config.json`, safetensors and their index, the
tokenizer's files and the generation config. Pickled weights (`*.bin`, `*.pt`) and remote code are
never fetched. `huggingface_hub` is imported only when a repo id is resolved (importing bd_core
stays as cheap as jax and numpy).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from ._config import ConfigError

# What a model and its tokenizer are read from; nothing else is downloaded.
HUB_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
"""The file patterns `resolve_pretrained` fetches from a Hub repo: config, weights, tokenizer and chat template."""
SHAPE_FILES = tuple(f for f in HUB_FILES if "safetensors" not in f)
"""What `resolve_pretrained(..., weights=False)` fetches: what a plan reads (no weights)."""
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(ConfigError):
    """A Hub checkpoint that cannot be had: unknown, not cached while offline, or a bad revision."""


@dataclasses.dataclass(frozen=True)
class PretrainedSource:
    """A released checkpoint's files: `folder` holds them; `repo_id`, `revision` (as asked) and
    `commit` (the snapshot's resolved 40-hex commit) when they came from the Hub, else None.

    Attributes:
        folder: the local folder with the files.
        repo_id: the Hub repo id, or None for a local folder.
        revision: the branch, tag or commit asked for.
        commit: the commit the revision resolved to.
    """

    folder: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """The source as a checkpoint's identity and a run's metadata record it (no machine path for
        a Hub snapshot, whose cache folder differs between hosts)."""
        if self.repo_id is None:
            return {"folder": str(self.folder)}
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def is_repo_id(ref: str | os.PathLike) -> bool:
    """`org/name` that is not an existing local path (a local folder always wins)."""
    text = os.fspath(ref)
    return (bool(_REPO_ID.match(text)) and not Path(text).exists() and not text.startswith(".")
            and not text.endswith((".json", ".safetensors", ".toml", ".jsonl")))


def _offline() -> bool:
    from huggingface_hub import constants

    raw = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE if raw is None else raw.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _cache_dir() -> str | None:
    """The cache the environment names now (the Hub library reads it once, at its import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def resolve_pretrained(ref: str | os.PathLike, revision: str | None = None, *,
                       weights: bool = True) -> PretrainedSource:
    """The folder of `ref` (a local checkpoint folder, or a Hub repo id at `revision`: a branch, tag
    or commit, default `main`), downloading the model's files (`HUB_FILES`; without `weights`, the
    config and tokenizer files only, `SHAPE_FILES`, as an ahead-of-time plan needs) into the Hub
    cache unless they are there or `HF_HUB_OFFLINE` is set. Errors name the repo and say how to
    get it."""
    text = os.fspath(ref)
    if not is_repo_id(text):
        if revision is not None:
            raise HubError(f"revision={revision!r} is given for {text!r}, which is a local folder, not a Hub repo id "
                           f"(org/name); drop the revision, or name the repo")
        return PretrainedSource(Path(text))
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise HubError(f"{text!r} is a Hub repo id, and reading it needs huggingface_hub (a dependency of bd-core); "
                       "install it, or pass a local folder") from None
    offline = _offline()
    try:
        folder = huggingface_hub.snapshot_download(text, revision=revision, cache_dir=_cache_dir(),
                                                   allow_patterns=list(HUB_FILES if weights else SHAPE_FILES),
                                                   local_files_only=offline)
    except errors.RevisionNotFoundError:
        raise HubError(f"{text}: revision {revision!r} does not exist; give a branch, tag or commit of the "
                       "repo") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{text}: no local folder of that name, and no such Hub repo (or it is private and no token "
                       "is set); check the path or the id, or log in with `hf auth login`") from None
    except getattr(errors, "IncompleteSnapshotError", ()) as err:  # files of the repo missing from its snapshot
        fetch = f"hf download {text}{'' if revision is None else f' --revision {revision}'}"
        raise HubError(f"{text}: the Hub cache's snapshot lacks some of the model's files and the Hub cannot be "
                       f"reached ({str(err).split(': ', 1)[-1].split('. ')[0]}); fetch them with `{fetch}` where "
                       "the Hub is reachable") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, FileNotFoundError):
        at = "" if revision is None else f" at revision {revision!r}"
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        cached = _cached_revisions(text)
        if cached is not None:  # the repo is cached, but not at this revision
            fetch = f"hf download {text}{'' if revision is None else f' --revision {revision}'}"
            raise HubError(f"{text}{at}: the Hub cache holds this repo but not at that revision while {why}; it "
                           f"holds {', '.join(cached) or 'no complete revision'}. Without the Hub, give one of "
                           f"these (a branch or tag the cache knows, or a full 40-character commit), or fetch it "
                           f"with `{fetch}` where the Hub is reachable") from None
        raise HubError(f"{text}{at}: no local folder of that name, and the Hub repo is not in the Hub cache "
                       f"({_cache_dir() or 'the default cache'}) while {why}; "
                       f"fetch it where the Hub is reachable with `hf download {text}"
                       f"{'' if revision is None else f' --revision {revision}'}` and copy the cache "
                       "(HF_HUB_CACHE), or pass a local folder") from None
    folder = Path(folder)
    commit = folder.name if _COMMIT.match(folder.name) else None
    return PretrainedSource(folder, repo_id=text, revision=revision or "main", commit=commit)


def _cached_revisions(repo_id: str) -> list[str] | None:
    """The branches and tags (`refs/`), then the commits (`snapshots/`), that the Hub cache holds
    of `repo_id`; None where the cache holds nothing of it."""
    from huggingface_hub import constants

    folder = Path(_cache_dir() or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    if not folder.is_dir():
        return None
    refs = sorted(str(p.relative_to(folder / "refs")) for p in (folder / "refs").rglob("*") if p.is_file()) \
        if (folder / "refs").is_dir() else []
    commits = sorted(p.name for p in (folder / "snapshots").iterdir()) if (folder / "snapshots").is_dir() else []
    return refs + commits
