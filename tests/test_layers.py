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
    against = sorted(bdlm - ALLOWED_LAYERS[package])
    assert not against, f"{package} imports {against} against the layers"
    third_party = imports - bdlm - set(sys.stdlib_module_names) - {"jaxlib"}
    declared = declared_imports(member) | {name for dep in ALLOWED_LAYERS[package]
                                           for name in declared_imports(dep[3:])}
    missing = third_party - declared
    assert not missing, f"{package} imports {sorted(missing)}; packages/{member}/pyproject.toml does not declare them"


def test_core_depends_on_jax_numpy_and_the_hub_client_only():
    # huggingface_hub locates released checkpoints for bd_data (tokenizers) and bd_models (weights)
    # alike; it is imported only when a Hub repo id is resolved
    assert declared_imports("core") == {"jax", "jaxlib", "numpy", "huggingface_hub"}


def _own_package(path: Path) -> str | None:
    """The bdlm package a file belongs to (its source or its tests), or None (tests/, bench/, flows/)."""
    parts = path.relative_to(ROOT).parts
    return PACKAGES[parts[1]] if parts[0] == "packages" and parts[1] in PACKAGES else None


def test_no_private_import_across_packages():
    """A module may import another package's public names only; tests/, bench/ and flows/ import
    public names of every package."""
    offenders = []
    files = [p for folder in ("packages", "tests", "bench", "flows") for p in (ROOT / folder).rglob("*.py")]
    for path in files:
        own = _own_package(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                parts = name.split(".")
                if parts[0].startswith("bd_") and parts[0] != own and any(p.startswith("_") for p in parts[1:]):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


def _runtime_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """`from ... import` statements outside `if TYPE_CHECKING:` blocks."""
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in typing_only]


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at run time (relative and absolute)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            deps.update(t for t in [target, *(f"{target}.{a.name}" for a in node.names)] if t in modules)
        graph[name] = deps - {name}
    return graph


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports (modules on it, package `__init__`s included)."""
    memo: dict[str, list[str]] = {}

    def walk(name: str) -> list[str]:
        if name not in memo:
            memo[name] = [name]  # a cycle would stop here
            memo[name] = [name, *max((walk(d) for d in graph[name]), key=len, default=[])]
        return memo[name]

    return max((walk(name) for name in graph), key=len)


def test_imports_inside_bd_train_are_at_most_six_modules_deep():
    # `python -m` launchers (`__main__`) are roots nothing imports: a line that forwards to a module
    # is not a level of the library
    graph = import_graph(ROOT / "packages" / "train" / "src" / "bd_train")
    chain = longest_chain({name: deps for name, deps in graph.items() if not name.endswith(".__main__")})
    assert len(chain) <= 6, " -> ".join(chain)


def code_lines(source: str) -> int:
    """Lines of code: docstrings (what the reference shows), comments and blank lines not counted."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if i not in docs and line.strip() and not line.strip().startswith("#"))


def test_stage_recipes_are_short_and_import_no_other_stage():
    graph = import_graph(ROOT / "packages" / "train" / "src" / "bd_train")
    recipes = {f"bd_train.stages.{name}" for name in ("sft", "opd", "grpo", "rft")}
    for recipe in recipes:
        assert not graph[recipe] & recipes, f"{recipe} imports {sorted(graph[recipe] & recipes)}"
        path = ROOT / "packages" / "train" / "src" / "bd_train" / "stages" / f"{recipe.split('.')[-1]}.py"
        assert code_lines(path.read_text()) <= 80, f"{path.name} has more than 80 lines of code"
