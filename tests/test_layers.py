"""Imports go down the layers only, and each package declares what it imports."""

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"core": "bd_core", "data": "bd_data", "models": "bd_models", "train": "bd_train"}
# The bdlm packages each layer may import.
ALLOWED_LAYERS = {
    "bd_core": set(),
    "bd_data": {"bd_core"},
    "bd_models": {"bd_core"},
    "bd_train": {"bd_core", "bd_data", "bd_models"},
}
# Import names of distributions that are not spelled like their import.
IMPORT_NAMES = {"orbax-checkpoint": "orbax", "absl-py": "absl"}


def imported_modules(package_dir: Path) -> set[str]:
    names = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def declared_imports(member: str) -> set[str]:
    project = tomllib.loads((ROOT / "packages" / member / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["dependencies"]:
        dist = requirement.split("==")[0].split(">=")[0].split("[")[0].strip()
        names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names


@pytest.mark.parametrize("member", sorted(PACKAGES))
def test_imports_go_down_the_layers_and_are_declared(member):
    package = PACKAGES[member]
    imports = imported_modules(ROOT / "packages" / member / "src" / package) - {package}
    bdlm = {name for name in imports if name.startswith("bd_")}
    assert bdlm <= ALLOWED_LAYERS[package], f"{package} imports {sorted(bdlm - ALLOWED_LAYERS[package])} against the layers"
    third_party = imports - bdlm - set(sys.stdlib_module_names) - {"jaxlib"}
    declared = declared_imports(member) | {name for dep in ALLOWED_LAYERS[package] for name in declared_imports(dep[3:])}
    missing = third_party - declared
    assert not missing, f"{package} imports {sorted(missing)} but packages/{member}/pyproject.toml does not declare them"


def test_core_depends_on_jax_and_numpy_only():
    assert declared_imports("core") == {"jax", "jaxlib", "numpy"}
