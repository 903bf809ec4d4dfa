"""A plan's costs from cut models (`--cost extrapolated`): the programs of a stage lowered from
the model cut to 2 and 4 layers, their unrolled twins' counts extended to the model's depth, against
the program's own fully unrolled twin. Built as a plan builds them and compiled for this host's
CPU (the mechanism; how near libtpu's counts come for SDAR-1.7B is `bench/plan_extrapolation.py`'s)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax
import pytest

from bd_models import make_mesh
from bd_train._plan_programs import Extrapolated
from bd_train._tpu import CHIPS
from bd_train.plan import Plan, StagePlan, compile_program, format_plan, stage_lowered

SMOKE = Path(__file__).resolve().parents[3] / "flows" / "configs" / "smoke.toml"


@pytest.fixture(autouse=True)
def _shapes_in_contracts():
    """A plan builds the batch contracts from shapes (`jax.ShapeDtypeStruct`s stand where they
    hold arrays), which the suite's runtime shape checks refuse; `python -m bd_train.plan` runs
    without them, and so do these tests."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


MEMO: dict = {}  # programs compiled already, by their StableHLO, as a plan keeps them


def _compiled(data: dict, stage: str, cost: str, names: tuple[str, ...]) -> dict:
    """The programs `names` of `stage`, lowered as a plan lowers them on one CPU device and compiled."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return {p.program: compile_program(p, CHIPS["v5e"], MEMO) for p in stage_lowered(data, stage, mesh, cost=cost)
            if p.program in names}


def test_extrapolated_costs_are_near_the_unrolled_ones_and_marked():
    """A 6-layer student's SFT step: FLOPs and bytes accessed from its cuts to 2 and 4 layers against
    its own fully unrolled twin; the table marks them `~`."""
    data = tomllib.loads(SMOKE.read_text())
    data["student"]["n_layers"] = 6
    chip = CHIPS["v5e"]
    exact, approx = (_compiled(data, "sft-student", cost, ("train step",)) for cost in ("all", "extrapolated"))
    want, got = exact["train step"], approx["train step"]
    assert want.cost_from == "unrolled" and got.cost_from == "extrapolated"
    assert got.flops == pytest.approx(want.flops, rel=0.01)
    assert got.bytes_accessed == pytest.approx(want.bytes_accessed, rel=0.05)
    assert (got.argument, got.temp) == (want.argument, want.temp)  # the same program, for memory
    # The table marks the extrapolated figures as approximations.
    text = format_plan(Plan("deep", "v5e:1x1", {"data": 1, "fsdp": 1, "model": 1}, 1, 1, chip.hbm, chip.peak_flops,
                            [StagePlan("sft-student", [got], chip.usable_hbm)], chip.usable_hbm))
    row = next(line for line in text.splitlines() if line.startswith("| sft-student | train step |")).split(" | ")
    assert row[10].startswith("~") and "~" in row[11] and "~" in row[12], row
    assert "marked ~" in text


def test_a_model_no_deeper_than_the_cut_is_its_own_cut():
    """The smoke preset's one-layer models are their own cuts: each twin an extrapolated cost reads
    is the program's own unrolled twin (the same StableHLO), at both points; the samplers get none."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    data = tomllib.loads(SMOKE.read_text())
    exact, approx = ({p.program: p for p in stage_lowered(data, "opd", mesh, cost=cost)}
                     for cost in ("all", "extrapolated"))
    for name in ("train step", "teacher forward"):
        cost = approx[name].cost
        assert isinstance(cost, Extrapolated) and cost.layers == 1 and [k for k, _, _ in cost.points] == [1, 1]
        assert all(twin.as_text() == exact[name].cost[0].as_text() for _, twin, _ in cost.points), name
    assert approx["held-out decoding"].cost is None and approx["rollouts"].cost is None
    step = approx["rollouts: one denoising step"].cost  # no loop: its own count, at the model's depth
    assert isinstance(step, tuple) and step[0].as_text() == exact["rollouts: one denoising step"].cost[0].as_text()
