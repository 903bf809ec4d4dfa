"""Train the math preset's student by SFT and show how math-verify scored its held-out answers:

    python examples/math/sft_student.py [--out runs/math]

Prints greedy accuracy, mean reward and pass@k on the 200 eval problems, and the correct answers
whose text differs from the eval file's (`17/5` for `3.4`, `24/9` for `\\frac{8}{3}`): exact match
would have scored those 0. The checkpoint's config holds absolute data paths, so
`python -m bd_train.evaluate --checkpoint <the printed folder>` works from any directory.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path

from bd_train.stages import RunDir, parse_pipeline_config, run_sft

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "flows" / "configs" / "math.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "math", help="the run's output folder")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    data = tomllib.loads(PRESET.read_text())
    data["task"]["params"] = {key: str(ROOT / path) for key, path in data["task"]["params"].items()}
    data["eval"]["samples_shown"] = data["eval"]["n"]  # every completion, to compare with the file's text
    data["run"]["output_dir"] = str(args.out)
    config = parse_pipeline_config(data)
    result = run_sft(config, RunDir.create(config, run_id="math-sft-student"), role="student")
    evaluation = result.evaluation
    assert evaluation is not None  # every stage evaluates on the held-out split when it finishes
    print(f"checkpoint: {result.checkpoint_dir}")
    print("  ".join(f"{name} {value:.3f}" for name, value in evaluation.metrics().items() if name != "n"))
    correct = [s for s in evaluation.samples if s.reward == 1.0]
    rewritten = [s for s in correct if s.completion.strip() != s.answer.strip()]
    print(f"{len(correct)} of {evaluation.n} correct; {len(rewritten)} of them differ from the eval file's text:")
    for s in rewritten:
        print(f"  {s.prompt:<12} eval file {s.answer:<14} model {s.completion}")


if __name__ == "__main__":
    main()
