"""Where benchmarks write: `bench/results/<name>.json` (flat name -> number) and their own section
of BENCHMARKS.md, between `<!-- <name>:start -->` and `<!-- <name>:end -->` markers."""

import json
import os
import platform
import re
from pathlib import Path

from bd_core import huge_page_malloc_active

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = ROOT / "BENCHMARKS.md"


def results_path(name: str) -> Path:
    return ROOT / "bench" / "results" / f"{name}.json"


def write_results(name: str, results: dict) -> None:
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def machine() -> str:
    """The CPU this process may use, as each section names it: XLA compiles for the processor it
    runs on, so another CPU model gives other speeds and, after training, other numbers; and whether
    malloc backs XLA's buffers with huge pages (bd_core._host_memory), which moves step times."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{cores} cores, {platform.processor() or platform.machine()}"
    info: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "without AVX2"
    malloc = "malloc on huge pages" if huge_page_malloc_active() else "malloc on 4 KiB pages"
    return (f"{cores} cores of {info.get('model name', platform.machine())} (CPU family {info.get('cpu family', '?')}, "
            f"model {info.get('model', '?')}), {isa}, {malloc}")


def device_machine(device) -> str:
    """The machine a device's figures were measured on: this host, with the accelerator's chip when
    the device is one."""
    return machine() if device.platform == "cpu" else f"one {device.device_kind} beside {machine()}"


def reserved_bytes(result: dict) -> int | None:
    """A TPU runtime's peak of the bytes it reserved for compiled programs' temporaries, from a
    result's stored `memory_stats` (None where not kept; other runtimes report 0)."""
    return (result.get("memory_stats") or {}).get("peak_bytes_reserved") or None


def write_section(name: str, body: str, markdown: Path = MARKDOWN, *, measured_on: str | None = None) -> None:
    """Replace this benchmark's section of `markdown` (BENCHMARKS.md unless given; appended if
    missing), nothing else. The section ends with the machine it was measured on: this one unless
    `measured_on` names another (an accelerator's results written here from its JSON)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.strip()}\n\nMachine: {measured_on or machine()}.\n{end}"
    text = markdown.read_text() if markdown.exists() else "# bdlm benchmarks\n"
    if start in text and end in text:
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    markdown.write_text(text)


def preset_data(base: dict, *, seed: int, output_dir: str | Path, **sections: dict) -> dict:
    """A copy of a preset's TOML data with `[run] seed/output_dir` set and each `sections[name]`
    merged into `[name]` (a dict value merges into the sub-table it names, e.g. `optim`)."""
    data = json.loads(json.dumps(base))  # a deep copy of plain TOML data
    data.setdefault("run", {}).update(seed=seed, output_dir=str(output_dir))
    for name, overrides in sections.items():
        section = data.setdefault(name, {})
        for key, value in overrides.items():
            section[key] = {**section.get(key, {}), **value} if isinstance(value, dict) else value
    return data
