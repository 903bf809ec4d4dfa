"""`bench/accelerator.py` (the GPU benchmark: bf16 train-step MFU, Pallas vs XLA attention) runs
end to end at its small size on CPU, so it is ready when a GPU is: every kernel's bfloat16 value
and gradients stay near float32 dense attention, and its BENCHMARKS.md section renders."""

import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import accelerator  # noqa: E402  (bench/ is a folder of scripts, not a package)


def test_small_size_measures_and_renders(tmp_path):
    results = accelerator.measure("small", steps=1)
    assert str(results["device"]).startswith("cpu")
    for impl in ("pallas", "blocked"):
        assert results[f"step_{impl}_s"] > 0 and math.isfinite(results[f"mfu_{impl}"]) and results[f"mfu_{impl}"] > 0
    # bfloat16 inputs, probabilities cast to bfloat16 before P V in the flash kernels: a few percent
    # of the largest gradient entry; dense keeps P in float32.
    assert results["attention_dense_max_rel_error"] <= 0.01
    assert results["attention_blocked_max_rel_error"] <= 0.05
    assert abs(results["attention_pallas_max_rel_error"] - results["attention_blocked_max_rel_error"]) <= 1e-3

    markdown = tmp_path / "BENCHMARKS.md"
    accelerator.write_markdown(results, markdown)
    text = markdown.read_text()
    assert "<!-- accelerator:start -->" in text and "Device: cpu" in text
    assert all(f"| `{impl}` |" in text for impl in ("dense", "blocked", "pallas"))
