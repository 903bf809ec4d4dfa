"""MkDocs hooks: what the site makes at build time from the code and the repository.

- Markers in committed pages are filled in (`<!-- generated: NAME -->`, see `GENERATORS`): the
  preset tables from the config classes, and the summary `make run` prints from a committed summary.
- `benchmarks.md`, `scaling-details.md`: BENCHMARKS.md and SCALING.md as they are, their figures
  copied beside them as `assets/*.png`.
- Links in the pages point at repository files, so that they work on a code host too; here
  those to README, BENCHMARKS.md, SCALING.md and `bench/results/*.png` become their pages and
  assets, and links to other repository files become their names in code.
- `assets/attention-mask.png`: the attention rule of an SFT layout, drawn from `bd_core`.
"""

from __future__ import annotations

import io
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generated  # noqa: E402  (this folder, put on the path above: mkdocs loads hooks by file)

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"BENCHMARKS.md": "benchmarks.md", "SCALING.md": "scaling-details.md", "README.md": "index.md"}
GENERATORS = {"presets": generated.preset_tables, "make-run": generated.make_run_printout}
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def site_target(repo_path: str) -> str | None:
    """The site path (from the docs root) of a repository file, or None when the site has no page for it."""
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    if repo_path in PAGES:
        return PAGES[repo_path]
    if repo_path.startswith("bench/results/") and repo_path.endswith(".png"):
        return f"assets/{Path(repo_path).name}"
    return None


def relink(text: str, page_path: str) -> str:
    """Rewrite the links of a page at repository path `page_path` for the site (see the module docstring)."""
    folder = posixpath.dirname(page_path)
    site_folder = posixpath.dirname(site_target(page_path) or page_path) or "."

    def link(match: re.Match) -> str:
        bang, label, target = match.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(folder, path))
        to = site_target(repo_path)
        if to is None:
            return label if label.startswith("`") or bang else f"`{label}`"
        url = posixpath.relpath(to, site_folder) + (f"#{anchor}" if anchor else "")
        return f"{bang}[{label}]({url})"

    out, fence = [], False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fence = not fence
        out.append(line if fence else _LINK.sub(link, line))
    return "".join(out)


def fill_markers(text: str) -> str:
    def fill(match: re.Match) -> str:
        return GENERATORS[match.group(1)]()

    return re.sub(r"<!-- generated: ([\w-]+) -->", fill, text)


def mask_png() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from bd_core import ViewLayout, attention_allowed

    # A 4-token prompt (one block, its first token padding), an 8-token completion (blocks of 4),
    # then one noisy copy of the completion: BD3-LM's x_0 (+) x_t, as SFT packs it.
    b, prompt, new = 4, 4, 8
    clean = np.arange(prompt + new)
    positions = np.concatenate([clean, np.arange(prompt, prompt + new)])
    blocks = positions // b
    views = np.concatenate([np.zeros(prompt + new, int), np.ones(new, int)])
    valid = np.ones(len(positions), bool)
    valid[0] = False
    layout = ViewLayout(*(np.asarray(a)[None] for a in (positions, positions, blocks, views, valid)))
    allowed = np.asarray(attention_allowed(layout))[0]
    labels = [("pad" if not valid[i] else f"{'x0' if views[i] == 0 else 'xt'} b{blocks[i]}") for i in range(len(views))]
    fig, ax = plt.subplots(figsize=(6.4, 6.4))
    ax.imshow(allowed, cmap="Blues", vmin=0, vmax=1.4)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    for edge in (prompt + new - 0.5,):
        ax.axhline(edge, color="black", lw=1)
        ax.axvline(edge, color="black", lw=1)
    ax.set_xlabel("key (may be attended)")
    ax.set_ylabel("query")
    ax.set_title("SFT layout [clean prompt + completion | noisy completion]", fontsize=9)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def on_files(files, config):
    def add(uri: str, content: str | bytes) -> None:
        files.append(File.generated(config, uri, content=content))

    add("benchmarks.md", relink((ROOT / "BENCHMARKS.md").read_text(), "BENCHMARKS.md"))
    add("scaling-details.md", relink((ROOT / "SCALING.md").read_text(), "SCALING.md"))
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        add(f"assets/{png.name}", png.read_bytes())
    # A copy is committed for readers of the repository's files; the site draws it afresh.
    committed = files.get_file_from_path("assets/attention-mask.png")
    if committed is not None:
        files.remove(committed)
    add("assets/attention-mask.png", mask_png())
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.generated_by:
        return fill_markers(markdown)
    return fill_markers(relink(markdown, f"docs/{page.file.src_uri}"))
