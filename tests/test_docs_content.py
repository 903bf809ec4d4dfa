"""What the documentation promises without building it: every exported name and its public methods
have a docstring (the reference shows it) and their ```python examples run as written, every
preset key has a description (the preset page shows it), and every link of README and the `docs/`
pages resolves to a file of the repository, so that they also work where the repository is read as
files (a code host)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("bd_core", "bd_data", "bd_models", "bd_train", "bd_train.stages", "bd_train.evaluate",
           "bd_train.distributed", "bd_train.plan")
LINK = re.compile(r"(?<![`\w])!?\[[^\]]*\]\(([^)\s]+)\)")


def exported(module_name: str) -> list[str]:
    """The names a module exports: its `__all__`, else every public non-module name."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"]
    return list(names)


@pytest.fixture(scope="module")
def api():
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "packages" / p / "src")
                                               for p in ("core", "data", "models", "train")])
    for package in ("bd_core", "bd_data", "bd_models", "bd_train"):
        loader.load(package)
    loader.resolve_aliases(implicit=False, external=None)
    return loader.modules_collection


def _documented(obj) -> bool:
    return bool(obj.docstring and obj.docstring.value.strip())


def test_every_exported_name_and_public_method_has_a_docstring(api):
    missing = []
    for module_name in MODULES:
        module = api[module_name]
        for name in exported(module_name):
            obj = module.members[name]
            target = obj.final_target if obj.is_alias else obj
            if not _documented(target):
                missing.append(f"{module_name}.{name}")
            if target.is_class:
                missing += [f"{module_name}.{name}.{m}" for m, member in target.members.items()
                            if not m.startswith("_") and not member.is_alias and member.is_function
                            and not _documented(member)]
    assert not missing, f"no docstring: {missing}"


def test_every_preset_key_has_a_description():
    sys.path.insert(0, str(ROOT / "docs_build"))
    try:
        import generated
    finally:
        sys.path.remove(str(ROOT / "docs_build"))
    assert not generated.undocumented_keys(), (
        "preset keys without a description (add them to the `Attributes:` section of their config class's "
        f"docstring): {generated.undocumented_keys()}")
    assert "`teacher_steps`" in generated.preset_tables()


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return LINK.findall(text)


PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve_to_repository_files(page):
    dead = []
    for target in _links(ROOT / page):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.partition("#")[0]
        if not (ROOT / page).parent.joinpath(path).resolve().exists():
            dead.append(target)
    assert not dead, f"{page}: links to files that are not in the repository: {dead}"


def test_readme_stays_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    block = "\n".join(lines[:8])
    assert "make run" in block and "make test" in block


def test_readme_shows_what_make_run_prints():
    """README's printout is the one the site generates from the committed summary, to the character."""
    sys.path.insert(0, str(ROOT / "docs_build"))
    try:
        import generated
    finally:
        sys.path.remove(str(ROOT / "docs_build"))
    assert generated.make_run_printout() in (ROOT / "README.md").read_text()


def _examples() -> dict[str, str]:
    """Every ```python block of the docstrings of exported names and their methods, by name."""
    found: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in exported(module_name):
            obj = getattr(module, name)
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{m}", v) for m, v in vars(obj).items() if not m.startswith("_")]
            for label, member in members:
                doc = inspect.getdoc(member) if callable(member) or inspect.isclass(member) else None
                where = f"{getattr(member, '__module__', module_name)}.{getattr(member, '__qualname__', label)}"
                for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc or "", re.S)):
                    found.setdefault(f"{where}#{i}", textwrap.dedent(block))
    return found


def test_docstring_examples_run(tmp_path):
    examples = _examples()
    assert len(examples) >= 6, sorted(examples)
    script = ["import traceback", "failed = []"]
    for label, code in sorted(examples.items()):
        script += [f"try:\n    exec({code!r}, {{'__name__': '__example__'}})",
                   f"except Exception:\n    failed.append({label!r}); traceback.print_exc()"]
    script += [f"print('examples run:', {len(examples)})", "raise SystemExit(1 if failed else 0)"]
    (tmp_path / "examples.py").write_text("\n".join(script))
    done = subprocess.run([sys.executable, "examples.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
