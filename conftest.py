"""Test-session setup shared by every package: 8 virtual CPU devices before jax is imported, and
XLA's CPU backend at optimization level 0; hypothesis derandomized.

The suite compiles hundreds of small programs and runs few large ones, so compiling is most of its
time; unoptimised CPU code compiles 2-3x faster (a sampler of the default preset: 3.0 s against
6.8 s), and compile-bound test files ran 20-30% faster. What the tests compare is computed in one
mode (a path against its reference, a resumed run against an uninterrupted one), so they hold in
either; the pipeline and the benchmarks compile at XLA's default level. Processes that tests start get the
same level through `child_xla_flags`.
"""

import atexit
import gc
import json
import os
import shutil
import tempfile

import pytest

DEVICES_FLAG = "--xla_force_host_platform_device_count"
os.environ.setdefault("XLA_FLAGS", f"{DEVICES_FLAG}=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Metaflow reads its user name when imported, and refuses root.
os.environ.setdefault("METAFLOW_USER", "bdlm-test")
# Every process the tests start (flow steps, stage chains, group workers) shares one persistent
# compilation cache for the whole session, every program however fast it compiled (the stages
# honour JAX's variables: `Run.enable_compilation_cache`), so a chain that another test, or an
# earlier attempt, already compiled does not compile again. A size limit turns on the cache's
# file lock: the two pytest workers and their children read and write it at once. The pytest
# process that creates the folder (the xdist controller; its workers inherit the variables)
# removes it at exit.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bdlm-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import jax  # noqa: E402  (after the environment above)
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and every fresh clone (no example database):
# a suite that is green once is green every time. `HYPOTHESIS_PROFILE=explore` draws new ones.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The stages turn on JAX's persistent compilation cache (`Run.enable_compilation_cache`): it pays in
# Metaflow steps and the other processes tests start, and saves little in this one long-lived
# process, where it stays off. (Late in full runs, compiling the 8-device OPD step in this process crashed: once in the
# cache's executable write, and with the cache off in the compile itself. That chain now runs in
# processes of its own, `tests/stages_worker.py`.) Tests that start processes keep the cache.
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def child_xla_flags() -> str:
    """`XLA_FLAGS` for a process a test starts: this session's flags without the virtual device
    count (a child sets its own, or runs on one device)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICES_FLAG))


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """After each test file, JAX's in-memory caches are dropped. Every program XLA:CPU compiles
    keeps about six memory mappings of its code while cached (300 small programs: 437 -> 2,326
    mappings; 551 after `jax.clear_caches()`), and a worker that runs a few hundred test files
    compiles thousands: near the kernel's limit (`vm.max_map_count`, 65,530 here) mmap fails inside
    XLA's compiler and the worker dies with a segmentation fault (seen once, late in a full run, in
    `test_scoring.py`, with the other worker at 30,742 mappings). Programs are rarely shared across
    files, and the processes tests start have their own caches."""
    yield
    jax.clear_caches()
    gc.collect()


# Test files that take minutes (measured: seconds of one run, 2 workers on 2 cores), started
# first: pytest-xdist hands out whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`; its default orders by test count, which left single-test chains of
# minutes for the end, with one worker idle). Longest first keeps both workers busy to the end.
SLOW_FILES = {
    "tests/test_group.py": 724, "packages/train/tests/test_plan.py": 419, "tests/test_stages_mesh.py": 318,
    "tests/test_pipeline.py": 269, "tests/test_guides.py": 161, "packages/train/tests/test_distributed.py": 153,
    "packages/train/tests/test_logits_chunks.py": 145, "packages/train/tests/test_trainer.py": 120,
    "packages/train/tests/test_driver.py": 105, "packages/models/tests/test_sampler.py": 93,
    "tests/test_sigkill.py": 84, "packages/train/tests/test_learning.py": 81, "packages/train/tests/test_guard.py": 79,
    "tests/test_recipe.py": 70, "packages/models/tests/test_sharding.py": 70,
}


_SECONDS_BY_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Every phase's time, summed by test file (on the controller, from every worker)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The time each test file took (setup, calls and teardown), slowest first: what SLOW_FILES
    and README's test section are kept from."""
    if not _SECONDS_BY_FILE:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_SECONDS_BY_FILE.items(), key=lambda item: -item[1])[:20]:
        terminalreporter.write_line(f"{seconds:7.1f}  {path}")
    terminalreporter.write_line(f"{sum(_SECONDS_BY_FILE.values()):7.1f}  in all ({len(_SECONDS_BY_FILE)} files)")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    weight = {os.path.join(root, path): seconds for path, seconds in SLOW_FILES.items()}
    items.sort(key=lambda item: -weight.get(str(item.path), 0))  # stable: the rest keep their order


HUB_FIXTURES = os.path.join(os.path.dirname(__file__), "packages", "models", "tests", "fixtures", "hf")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face Hub cache in the Hub library's own layout
    (`models--ORG--NAME/snapshots/<commit>/`, `refs/<branch>`), filled from the committed fixture
    checkpoints: `hub_cache(folder, repo_id, commit, refs=("main",))` adds a snapshot (with
    `tokenizer_from`, another fixture's tokenizer files replace the folder's: the ChatML-templated
    `chatml` one, say); the environment points `HF_HUB_CACHE` at it with `HF_HUB_OFFLINE=1`."""
    import shutil

    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def add(folder: str, repo_id: str, commit: str, refs=("main",), tokenizer_from: str | None = None,
            weights: bool = True):
        repo = root / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / commit
        shutil.copytree(os.path.join(HUB_FIXTURES, folder), snapshot,
                        ignore=shutil.ignore_patterns("reference.npz", "config.v4.json"))
        if tokenizer_from is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(HUB_FIXTURES, tokenizer_from, name), snapshot / name)
        # The repo's file listing, which the Hub library caches beside a download and checks an offline
        # snapshot against: `weights=False` leaves the weights out of the snapshot, not out of the repo.
        files = {f.name: {"size": f.stat().st_size, "blob_id": f"{i:040x}"}
                 for i, f in enumerate(sorted(snapshot.iterdir()))}
        (repo / "trees").mkdir(parents=True, exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))
        if not weights:
            for name in files:
                if "safetensors" in name:
                    (snapshot / name).unlink()
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        for ref in refs:
            (repo / "refs" / ref).write_text(commit)
        return snapshot

    return add
