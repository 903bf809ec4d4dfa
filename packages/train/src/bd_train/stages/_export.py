"""A stage's model written as a Hugging Face checkpoint (`[run] export`): the release's config and
tokenizer settings kept, what the run changed recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from bd_data import HFTokenizer, tokenizer_config
from bd_models import BlockDiffusionLM, merge, read_hf_config, save_pretrained

if TYPE_CHECKING:
    from ._run import Run

TEMPLATE_FILE = "chat_template.jinja"


def export_model(run: Run, model: BlockDiffusionLM, stage: str, role: str) -> Path:
    """`model` (adapters merged) as a Hugging Face checkpoint in `<run>/export/<stage>`: the
    pretrained source's config keys kept and its dtype (a bfloat16 release exports in bfloat16,
    whatever the master weights trained in), the block size and mask token id recorded; the
    tokenizer as used, with the release's tokenizer_config.json (its chat template, padding and
    class kept) and the mask and end-of-text tokens the run used; the chat template the prompts
    used, if any, in `chat_template.jinja` (else the release's own file, if it has one)."""
    model = merge(model)
    folder = Path(run.where.run_dir) / "export" / stage
    section = getattr(run.config, role)
    base = dict(read_hf_config(section.folder)) if section.folder else {}
    tok = run.tokenizer
    base.update(mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    source = {"stage": stage, "role": role, "run": str(run.where.run_dir)}
    if section.source is not None:
        source["pretrained"] = section.source.to_dict()
    released = base.get("torch_dtype") or base.get("dtype")
    dtype = released if released in ("float32", "bfloat16", "float16") else None
    save_pretrained(model, folder, base_config=base, source=source, dtype=dtype)
    if jax.process_index() == 0 and isinstance(tok, HFTokenizer):
        write_tokenizer(run, tok, folder)
    return folder


def write_tokenizer(run: Run, tok: HFTokenizer, folder: Path) -> None:
    """tokenizer.json as used, and tokenizer_config.json: the release's (beside its tokenizer.json,
    special_tokens_map.json's tokens folded in) with the run's mask and end-of-text tokens."""
    tok.save(folder / "tokenizer.json")
    released = Path(run.config.tokenizer_file).parent if run.config.tokenizer_file else None
    config = tokenizer_config(released) if released is not None else {}
    config.update(mask_token=tok.token(tok.mask_id), eos_token=tok.token(tok.eos_id))
    template = run.chat_template
    if template is not None:  # the template the model was trained with travels with it
        config = {**dict(template.variables), **config}
        config.pop("chat_template", None)
        (folder / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    elif released is not None and (released / TEMPLATE_FILE).is_file():
        shutil.copyfile(released / TEMPLATE_FILE, folder / TEMPLATE_FILE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
