"""The documentation site builds with --strict (no broken link, missing page or unresolved
reference), its API reference covers every name the packages export, its pages open from
`file://` (no directory URLs) and nothing but pages and assets is published."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bd_core", "bd_data", "bd_models", "bd_train", "bd_train.stages", "bd_train.distributed")


def _inventory(site: Path) -> set[str]:
    """The object names of a built site's objects.inv (Sphinx inventory v2, zlib after 4 lines)."""
    data = (site / "objects.inv").read_bytes()
    body = data.split(b"\n", 4)[4]
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines() if line}


def test_site_builds_strict_and_references_every_exported_name(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    names = _inventory(site)
    missing = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, types.ModuleType) or name == "annotations":
                continue
            if f"{package}.{name}" not in names:
                missing.append(f"{package}.{name}")
    assert not missing, f"not in the API reference: {missing}"
    # the generated pages: every preset table, and the attention figure
    presets = (site / "reference" / "presets.html").read_text()
    for table in ("[task]", "[sft.corruption]", "[grpo.optim]", "[rft.sampler]", "[student.lora]", "[mesh]", "[run]"):
        assert table in presets, table
    assert "generated:" not in presets and "teacher_steps" in presets
    assert "student_grpo" in (site / "make-run.html").read_text()  # the printout, made from the committed summary
    assert (site / "assets" / "attention-mask.png").stat().st_size > 10_000
    published = [p.relative_to(site) for p in site.rglob("*") if p.is_file()]
    assert not [p for p in published if p.suffix == ".py"], "Python files are published"
    assert not (site / "reference" / "bd_models" / "index.html").exists()  # file:// opens pages, not folders
    for name in ("bd_models", "bd_train", "evaluate", "distributed", "plan"):
        assert (site / "reference" / f"{name}.html").is_file()
