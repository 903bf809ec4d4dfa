"""The guides and README's package examples run as written: every ```python block of the page, in
order, in a fresh process and a scratch folder holding the repository's `packages/` and `flows/`
(```py blocks are illustrations with placeholder paths and do not run). A page that drifts from
the code fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ["docs/packages.md", "docs/guides/released-checkpoint.md", "docs/guides/new-stage.md"]


def _script(page: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S))


@pytest.mark.parametrize("page", GUIDES)
def test_guide_runs(page, tmp_path):
    for folder in ("packages", "flows"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    (tmp_path / "guide.py").write_text(_script(page))
    env = {**os.environ, "WANDB_MODE": "offline", "BDLM_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "guide.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    if page == "docs/guides/released-checkpoint.md":
        export = tmp_path / "guide_runs" / "pipeline" / "guide" / "export" / "grpo"
        assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
        assert "'trained'" in done.stdout  # the adapters' parameter count was printed
