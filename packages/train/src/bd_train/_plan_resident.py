"""What a stage holds on each chip beside the program it runs: a plan compiles each program alone,
but a stage keeps its long-lived arrays between programs, so a program's peak on the chip is its
own plus those of them it does not take as arguments.

As the stages hold them (`bd_train.stages`):
- the student's train state (weights, optimizer state) lives through the whole stage, so its
  optimizer state sits beside the rollouts, and all of it beside OPD's teacher forward;
- OPD's teacher lives through the stage: beside the student's rollouts, train step (less its LM
  head, which the step takes as an argument) and held-out decoding;
- GRPO's KL reference (`beta > 0`) is a copy of the starting weights in full fine-tuning (under
  LoRA it is the adapted model's own base: nothing more);
- the held-out decoding after training runs on `merge(model)` once the train state is saved and
  let go: beside it only what the stage keeps (OPD's teacher, GRPO's reference copy). The OPD
  guard's decoding during training holds the whole train state beside `merge(model)` (under LoRA
  new arrays; in full fine-tuning the state's own weights, with the optimizer state beside), so
  OPD's held-out decoding counts it.

The train state's figures are the train step's own arguments (`params`, `optimizer`: logical bytes
per chip), so this is a lower bound of what is held: XLA pads small dimensions on a TPU.
"""

from __future__ import annotations

from typing import Any

from ._plan_shapes import bytes_per_chip


def held_beside(programs: list[Any], *, lora: bool, teacher: Any = None, head: Any = None,
                reference: bool = False) -> dict[str, int]:
    """`{program name: bytes per chip held beside it}` for `programs` (`_Program`s of one stage, with
    a "train step"); `teacher`/`head`: OPD's placed teacher and its head as the step takes it;
    `reference`: GRPO keeps a copy of the starting weights as its KL reference."""
    step = next(p for p in programs if p.program == "train step")
    weights, optimizer = step.params, step.optimizer
    teacher_bytes = bytes_per_chip(teacher) if teacher is not None else 0
    reference_bytes = weights if reference and not lora else 0
    beside_state = teacher_bytes + reference_bytes
    held = {"train step": teacher_bytes - (bytes_per_chip(head) if head is not None else 0) + reference_bytes,
            "rollouts": optimizer + beside_state,
            "rollouts: one denoising step": optimizer + beside_state,
            "teacher forward": weights + optimizer,
            # scoring runs on the reference itself (the copy, or under LoRA the state's own base)
            "reference scoring": optimizer + (weights if not lora else 0),
            # OPD's guard decodes during training too, with the state held; the final decoding does not
            "held-out decoding": (optimizer + (weights if lora else 0) if teacher is not None else 0) + beside_state}
    # a streamed step's programs take the whole train state, like the step
    return {p.program: held.get(p.program, held["train step"]) for p in programs}
