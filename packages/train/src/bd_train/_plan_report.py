"""What a plan finds (`bd_train.plan`): each stage's programs per chip, its rollouts costed, its
largest batch, and how they are shown: a markdown table per chip with a legend naming each column.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ._tpu import Chip, GiB

if TYPE_CHECKING:
    from ._plan_programs import ProgramPlan


@dataclasses.dataclass
class StagePlan:
    """The plan of one stage: its programs and whether they fit the chip.

    Attributes:
        stage: the stage's name (`sft-teacher`, `sft-student`, `opd`, `grpo`).
        programs: one plan per compiled program.
        usable_hbm: the HBM bytes libtpu lets one program use on a chip (`Chip.usable_hbm`).
        remedy: for a stage that does not fit, the first single change that fits.
        planned_with: for a batch the mesh cannot split, the change it was planned with.
        rollout: OPD's and GRPO's rollouts costed (`rollout_cost`), or None."""
    stage: str
    programs: list[ProgramPlan]
    usable_hbm: int
    remedy: str | None = None  # for a stage that does not fit: the first single change that fits
    planned_with: str | None = None  # a stage whose batch the mesh cannot split: the change it was planned with
    rollout: dict[str, Any] | None = None

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable_hbm and not any(p.refused for p in self.programs)


@dataclasses.dataclass
class Plan:
    """A preset's plan on a TPU topology; `format_plan` prints it, `to_json` writes it.

    Attributes:
        preset: the preset's name.
        topology: the topology, e.g. `v5e:2x4`.
        mesh: the mesh's axis sizes.
        chips: chips in the slice(s).
        hosts: hosts in the slice(s).
        hbm: HBM bytes per chip (published).
        peak_flops: the chip's bfloat16 peak, FLOP/s.
        stages: one plan per stage.
        usable_hbm: the HBM bytes libtpu lets one program use on a chip: what the verdicts compare against."""
    preset: str
    topology: str
    mesh: dict[str, int]
    chips: int
    hosts: int
    hbm: int
    peak_flops: float
    stages: list[StagePlan]
    usable_hbm: int

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready values (`--json` writes them)."""
        return {"preset": self.preset, "topology": self.topology, "mesh": self.mesh, "chips": self.chips,
                "hosts": self.hosts, "hbm": self.hbm, "usable_hbm": self.usable_hbm, "peak_flops": self.peak_flops,
                "stages": [{"stage": s.stage, "fits": s.fits, "peak": s.peak, "remedy": s.remedy,
                            "planned_with": s.planned_with, "rollout": s.rollout,
                            "programs": [{**dataclasses.asdict(p), "peak": p.peak} for p in s.programs]}
                           for s in self.stages]}


STEP_PARTS = ("train step", "reference scoring", "teacher forward")  # a step's programs besides its rollouts


def rollout_cost(stage: StagePlan, chip: Chip, chips: int) -> dict[str, Any] | None:
    """The rollouts of `stage` costed from its compiled denoising step (None for a stage without
    one): the step's estimated seconds, its bandwidth (XLA's bytes accessed / HBM bandwidth) and
    compute (FLOPs / bf16 peak) times and which is larger (their max, the estimate where the cost
    model gives none, is no bound: XLA counts bytes a step does not move), the seconds to read its
    arguments once (`read_seconds`: a lower bound), tokens per second per chip at the estimate and
    at most (tokens committed per step at least: rows x block / steps cap, over the slice's chips),
    one rollout batch's seconds at its most steps (blocks x steps cap; a threshold rule or rows
    that stop early take fewer), and that batch's share of the
    stage's step (rollouts + reference scoring or teacher forward + train step), where each of
    those has an estimate."""
    step = next((p for p in stage.programs if p.rollout and p.seconds and p.flops is not None), None)
    if step is None or step.rollout is None or step.seconds is None or step.flops is None:
        return None
    bandwidth = (step.bytes_accessed or 0.0) / chip.hbm_bandwidth
    compute = step.flops / chip.peak_flops
    read = step.argument / chip.hbm_bandwidth  # each argument read once at least: a true lower bound
    tokens = step.rollout["tokens_per_step"]
    batch = step.seconds * step.rollout["steps"]
    rest = [p.seconds for p in stage.programs if p.program in STEP_PARTS]
    known = [t for t in rest if t]
    share = batch / (batch + sum(known)) if rest and len(known) == len(rest) else None
    return {"rows": int(step.rollout["rows"]), "tokens_per_step": tokens, "step_seconds": step.seconds,
            "seconds_from": step.seconds_from, "bandwidth_seconds": bandwidth, "compute_seconds": compute,
            "bound": "bandwidth" if bandwidth >= compute else "compute",
            "tokens_per_second_per_chip": tokens / step.seconds / chips,
            "roofline_tokens_per_second_per_chip": tokens / max(bandwidth, compute) / chips,
            "read_seconds": read, "most_tokens_per_second_per_chip": tokens / max(read, compute) / chips,
            "steps": int(step.rollout["steps"]), "batch_seconds": batch, "share_of_step": share}


@dataclasses.dataclass
class LargestBatch:
    """A stage's largest batch per step that fits a slice (`largest_batch`).

    Attributes:
        section: the preset's section searched: `sft`, `opd` or `grpo`.
        key: its key searched: `batch_size` or `prompts_per_step`.
        batch: its largest value found that fits, or None where not even the smallest fits.
        microbatches: the microbatch count it was planned at: the preset's, or the layout remedy's
            where the preset's rows per microbatch do not split over the slice's data-parallel chips.
        capped: True when the largest size tried fit (the search stopped at its last doubling).
        stage: the stage's plan at that batch (its train step costed when `cost` asks), or None."""
    section: str
    key: str
    batch: int | None
    microbatches: int
    capped: bool
    stage: StagePlan | None

    @property
    def setting(self) -> str:
        """The preset key searched, as a preset names it: `[grpo] prompts_per_step`."""
        return f"[{self.section}] {self.key}"

    @property
    def step(self) -> ProgramPlan | None:
        """The stage's train step at the batch found, or None."""
        return next((p for p in self.stage.programs if p.program == "train step"), None) if self.stage else None

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready values: the stage's peak and its train step's plan at the batch."""
        step = self.step
        return {"setting": self.setting, "batch": self.batch, "microbatches": self.microbatches,
                "capped": self.capped, "peak": self.stage.peak if self.stage else None,
                "train_step": {**dataclasses.asdict(step), "peak": step.peak} if step else None}


LEGEND = """\
Columns (per chip; GiB = 2^30 bytes; nothing here ran on a TPU):
- params GiB, optimizer GiB: logical bytes of the model's weights and of the optimizer state among the
  arguments (each shard's elements times its dtype's size).
- arguments, outputs, temp GiB, code MiB: XLA's buffer assignment for the compiled TPU program, padded to
  TPU tiles (so arguments may exceed params + optimizer); outputs count only the buffers that do not reuse
  a donated argument's. Marked (logical): a program the compiler refuses, whose arguments and outputs are
  the logical bytes of their shapes; its temp, marked (rest), is the rest of the total the compiler named.
- held beside GiB: what the stage holds on the chip while the program runs that is not among its
  arguments: the OPD teacher's weights beside the student's programs (less the LM head its train step
  takes), the optimizer state beside the rollouts, the train state beside the teacher's forward and
  OPD's held-out decoding (its guard decodes during training; other stages let the state go before
  theirs), GRPO's reference copy in full fine-tuning; logical bytes.
- peak GiB: arguments + outputs + temp + code (or a refused program's total as the compiler named it) +
  held beside; % of usable HBM: of the HBM libtpu lets one program use, which the verdicts compare against.
- TFLOP/chip, est. s: XLA's FLOPs and its cost model's time (estimates, not timings) for a twin of the
  program with its layer loop unrolled; marked ~ (`--approx-cost`), extrapolated from twins of 2 and 3
  layers: FLOPs within 1% of the unrolled twin's, time an approximation (4% to 22% above it for
  SDAR-1.7B's train steps on a v5p-16); marked >=, the roofline bound max(FLOPs / peak, bytes accessed /
  HBM bandwidth) where the cost model gives no time. Empty where no twin was compiled (`--cost`; the
  samplers): the program's own count holds one pass of each loop, not its work.
- est. MFU: the model's matmul FLOPs per chip (3x forward; 2x with LoRA, whose frozen weights get no
  gradient) / (est. s x bf16 peak); marked <=, an upper bound from a roofline time; empty without a time.
- rollouts: one denoising step: the sampler's loop body alone (the block's noisy view of every row
  against the KV cache of the whole canvas, sampling, the commit): no loop, so XLA's count is its work.
  Under the verdicts: its time from XLA's count, max(bytes accessed / HBM bandwidth, FLOPs / peak): an
  estimate, not a bound (XLA counts bytes a step does not move: on a v5e chip such a step ran in 0.68x
  of it); at least: the time to read its arguments (weights, KV cache) once; tokens/s per chip (rows x
  block / steps cap tokens per step, over the chips), and one rollout batch at its most steps (blocks x
  steps cap) against the stage's other programs' estimated times.
Exit code: 0 every stage fits, 1 a stage does not fit, 2 an error."""


def format_plan(result: Plan) -> str:
    """The plan as a markdown table per chip (memory by kind, % of usable HBM, TFLOP, estimated seconds
    and MFU), each stage's verdict, and a legend naming what each column is."""
    def gib(n: int | float) -> str:
        return f"{n / GiB:.2f}"

    lines = [f"{result.preset} on {result.topology}: {result.chips} chips over {result.hosts} host(s), mesh "
             f"{result.mesh}; per chip: {result.hbm / GiB:.0f} GiB HBM, of which libtpu lets a program use "
             f"{result.usable_hbm / GiB:.2f} GiB; {result.peak_flops / 1e12:.0f} TFLOP/s bf16",
             "", "| stage | program | params GiB | optimizer GiB | arguments GiB | outputs GiB | temp GiB | code MiB | "
             "held beside GiB | peak GiB | % of usable HBM | TFLOP/chip | est. s | est. MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage in result.stages:
        for p in stage.programs:
            seconds, mfu = p.estimates(result.peak_flops)
            logical, rest = (" (logical)", " (rest)") if p.memory_from == "logical" else ("", "")
            flops = "" if p.flops is None else f"{p.flops / 1e12:.3g}"
            lines.append(f"| {p.stage} | {p.program} | {gib(p.params)} | {gib(p.optimizer)} | "
                         f"{gib(p.argument)}{logical} | {gib(p.output - p.alias)}{logical} | {gib(p.temp)}{rest} | "
                         f"{p.code / 2**20:.1f} | {gib(p.resident)} | "
                         f"{gib(p.peak)} | {100 * p.peak / result.usable_hbm:.0f}% | {flops} | {seconds} | {mfu} |")
    lines.append("")
    for stage in result.stages:
        for p in stage.programs:
            if p.refused:
                lines.append(f"{stage.stage}: {p.program}: the TPU compiler refuses it: {p.refused}")
        verdict = "fits" if stage.fits else f"DOES NOT FIT: {stage.remedy or 'no remedies tried (--no-remedies)'}"
        if stage.planned_with:
            verdict += f"; planned with {stage.planned_with}"
        lines.append(f"{stage.stage}: peak {gib(stage.peak)} GiB of {gib(result.usable_hbm)} GiB usable per chip: "
                     f"{verdict}")
        if stage.rollout:
            lines.append(_rollout_line(stage.stage, stage.rollout))
    lines += ["", LEGEND]
    return "\n".join(lines)


def format_largest(stage: str, found: LargestBatch, peak_flops: float) -> str:
    """One line: the stage's largest batch that fits, at which microbatch count, and its train
    step's estimated time and MFU there when costed."""
    where = (f"{stage}: largest [{found.section}] {found.key} that fits at [{found.section}] microbatches = "
             f"{found.microbatches}: ")
    if found.batch is None:
        return where + "none (down to one row per data-parallel chip per microbatch)"
    line = where + f"{found.batch}" + (" (the largest size tried: more may fit)" if found.capped else "")
    if found.stage is not None:
        line += f"; peak {found.stage.peak / GiB:.2f} GiB per chip"
        seconds, mfu = found.step.estimates(peak_flops) if found.step else ("", "")
        if mfu:
            line += f"; train step est. {seconds} s, est. MFU {mfu}"
    return line


def _rollout_line(stage: str, r: dict[str, Any]) -> str:
    share = "" if r["share_of_step"] is None else (
        f", {100 * r['share_of_step']:.0f}% of the stage's estimated step (rollouts + "
        f"{'teacher forward' if stage == 'opd' else 'reference scoring'} + train step)")
    est = f"{r['step_seconds']:.3g} s" + (" from XLA's count" if r["seconds_from"] == "roofline" else "")
    least = "" if r.get("read_seconds") is None else (
        f"; at least {r['read_seconds']:.3g} s to read its weights and KV cache once, so at most "
        f"{r['most_tokens_per_second_per_chip']:.3g} tokens/s per chip")
    return (f"{stage}: rollouts: one denoising step of {r['rows']} rows: est. {est} (bandwidth "
            f"{r['bandwidth_seconds']:.3g} s, compute {r['compute_seconds']:.3g} s: {r['bound']}-bound){least}; "
            f"{r['tokens_per_second_per_chip']:.3g} tokens/s per chip at the estimate ({r['tokens_per_step']:.3g} "
            f"tokens committed per step at least); one rollout batch (<= {r['steps']} steps): est. "
            f"{r['batch_seconds']:.3g} s{share}")
