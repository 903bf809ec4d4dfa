"""`python -m bd_train.plan`: every stage's programs compiled for a TPU slice from shapes, on this
CPU host. Runs with libtpu, from this environment or the plan's own venv (`make plan-env`, which
CI installs); skipped where neither has it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

from bd_models import BlockDiffusionLM, make_mesh, param_partition_specs
from bd_train import make_optimizer
from bd_train._plan_report import LEGEND
from bd_train._tpu import CHIPS, GiB, TopologyError, parse_topology, refusal_bytes
from bd_train.plan import Plan, ProgramPlan, StagePlan, format_plan
from bd_train.stages import Run, parse_pipeline_config

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "flows" / "configs" / "smoke.toml"
PLAN_PYTHON = ROOT / ".plan" / "bin" / "python"


def _python() -> str:
    if importlib.util.find_spec("libtpu") is not None:
        return sys.executable
    if PLAN_PYTHON.exists():
        return str(PLAN_PYTHON)
    pytest.skip("libtpu is not installed here or in .plan/ (make plan-env)")


def _plan(tmp_path, preset: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "plan.json"
    done = subprocess.run([_python(), "-m", "bd_train.plan", str(preset), "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    return done, json.loads(out.read_text()) if out.exists() else {}


def _per_chip(shapes, specs, mesh) -> int:
    """Bytes one chip holds of `shapes` split by `specs` on `mesh` (from the specs alone)."""
    total = 0
    for shape, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.P))):
        shard = [n // (int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
                       if axis is not None else 1) for n, axis in zip(shape.shape, (*spec, *[None] * len(shape.shape)))]
        total += int(np.prod(shard)) * shape.dtype.itemsize
    return total


@pytest.fixture(scope="module")
def smoke_plan(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """The smoke preset planned whole for v5e:2x2 over fsdp 2 x model 2, every program costed."""
    return _plan(tmp_path_factory.mktemp("smoke"), SMOKE, "--topology", "v5e:2x2", "--mesh", "fsdp=2,model=2")


def test_every_stage_compiles_for_v5e_with_exact_bytes_per_chip(smoke_plan):
    done, plan = smoke_plan
    assert done.returncode == 0, done.stderr[-3000:]
    assert plan["chips"] == 4 and plan["hbm"] == 16 * 2**30 and plan["mesh"] == {"data": 1, "fsdp": 2, "model": 2}
    assert plan["usable_hbm"] == CHIPS["v5e"].usable_hbm == int(15.75 * GiB)  # libtpu's figure, not the 16 GiB
    assert "of which libtpu lets a program use 15.75 GiB" in done.stdout and LEGEND in done.stdout
    programs = {(s["stage"], p["program"]): p for s in plan["stages"] for p in s["programs"]}
    assert {s["stage"] for s in plan["stages"]} == {"sft-teacher", "sft-student", "opd", "grpo"}
    assert {"rollouts", "teacher forward", "train step", "held-out decoding"} <= {p for s, p in programs if s == "opd"}
    assert ("grpo", "reference scoring") in programs  # smoke's GRPO has beta > 0
    # The rollouts costed from one denoising step, which is its own cost twin (no loop inside).
    config = Run(parse_pipeline_config(SMOKE.read_text())).config
    for stage in ("opd", "grpo"):
        step = programs[(stage, "rollouts: one denoising step")]
        assert step["flops"] > 0 and step["seconds"] > 0 and step["params"] > 0
        rollout = next(s for s in plan["stages"] if s["stage"] == stage)["rollout"]
        section = config.opd if stage == "opd" else config.grpo
        rows = section.prompts_per_step * (config.grpo.group_size if stage == "grpo" else 1)
        blocks, cap = config.canvas.max_new_tokens // config.canvas.block_size, config.canvas.block_size
        assert rollout["rows"] == rows and rollout["steps"] == blocks * cap
        assert rollout["bound"] == "bandwidth" and rollout["bandwidth_seconds"] > rollout["compute_seconds"]
        assert rollout["read_seconds"] == pytest.approx(step["argument"] / CHIPS["v5e"].hbm_bandwidth)
        assert rollout["tokens_per_second_per_chip"] == pytest.approx(
            rows * config.canvas.block_size / cap / step["seconds"] / 4)
        assert rollout["batch_seconds"] == pytest.approx(step["seconds"] * blocks * cap)
        assert 0 < rollout["share_of_step"] < 1
        assert f"{stage}: rollouts: one denoising step of {rows} rows: est." in done.stdout
    assert next(s for s in plan["stages"] if s["stage"] == "sft-teacher")["rollout"] is None

    setup = Run(parse_pipeline_config(SMOKE.read_text()))
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    for stage, role, section in (("sft-teacher", "teacher", setup.config.sft), ("sft-student", "student", None),
                                 ("opd", "student", setup.config.opd), ("grpo", "student", setup.config.grpo)):
        shapes = eqx.filter_eval_shape(BlockDiffusionLM, setup.model_config(role), key=jax.random.key(0))
        params = _per_chip(shapes, param_partition_specs(shapes, mesh), mesh)
        optim = (section or setup.config.sft).optim
        opt_state = eqx.filter_eval_shape(make_optimizer(Run.optimizer_config(optim, 10)).init, shapes)
        scalars = sum(x.dtype.itemsize for x in jax.tree.leaves(opt_state) if x.ndim == 0)  # step counts
        step = programs[(stage, "train step")]
        assert step["params"] == params, stage
        assert step["optimizer"] == 2 * params + scalars, stage  # AdamW's two moments mirror the weights
        # Logical bytes below XLA's: TPU layouts pad the tiny model's small dimensions to tiles.
        assert step["argument"] > step["params"] + step["optimizer"] and step["peak"] > 0
        assert step["memory_from"] == "xla" and step["required"] is None
        assert step["flops"] > 0 and step["seconds"] > 0 and step["model_flops"] > 0
        decoding = programs[(stage, "held-out decoding")]
        assert decoding["params"] == params
        # No unrolled twin for a sampler: no FLOPs, bytes accessed or time rather than one loop pass's.
        assert decoding["flops"] is None and decoding["bytes_accessed"] is None and decoding["seconds"] is None
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {stage} | held-out decoding |"))
        assert row.endswith("% |  |  |  |"), row
    # The student's held-out decoding is one program in every stage: compiled once, its figures reused.
    assert done.stderr.count("compiled sft-student: held-out decoding (") == 1
    decoding = programs[("sft-student", "held-out decoding")]
    own = lambda p: {k: v for k, v in p.items() if k not in ("stage", "resident", "peak")}  # noqa: E731
    for stage in ("opd", "grpo"):
        assert f"{stage}: held-out decoding: compiled before" in done.stderr
        assert own(programs[(stage, "held-out decoding")]) == own(decoding)
    # What each stage holds beside a program (logical bytes of the other programs' arguments).
    step, teacher = programs[("opd", "train step")], programs[("opd", "teacher forward")]
    state = step["params"] + step["optimizer"]
    assert 0 < step["resident"] < teacher["params"]  # the teacher, less the LM head the step takes
    assert programs[("opd", "rollouts")]["resident"] == step["optimizer"] + teacher["params"]
    assert teacher["resident"] == state
    assert programs[("opd", "held-out decoding")]["resident"] == step["optimizer"] + teacher["params"]
    grpo = programs[("grpo", "train step")]  # smoke's GRPO: full fine-tuning, beta > 0: a reference copy
    assert grpo["resident"] == grpo["params"] == programs[("grpo", "reference scoring")]["params"]
    assert programs[("grpo", "reference scoring")]["resident"] == grpo["params"] + grpo["optimizer"]
    for (stage, name), p in programs.items():
        assert p["peak"] == p["argument"] + p["output"] - p["alias"] + p["temp"] + p["code"] + p["resident"]
        if stage.startswith("sft-"):  # the step takes the state; the decoding runs once it is let go
            assert p["resident"] == 0, (stage, name)
    assert programs[("grpo", "held-out decoding")]["resident"] == grpo["params"]  # the reference copy alone


def test_splash_attention_compiles_for_tpu_with_its_kernels_costed(tmp_path, smoke_plan):
    """`--attention splash`: GRPO's programs (rollouts, replay scoring and the train step over the
    packed replay) compile with TPU's splash kernels on the same slice and mesh as the whole plan;
    the kernels' FLOPs, which XLA cannot see, are added to its count, and the rest of the step is the
    same program. (`--cost "train step"`: every program compiles, and only the train step, whose
    figures are compared, compiles its unrolled cost twin.)"""
    done, splash = _plan(tmp_path, SMOKE, "--topology", "v5e:2x2", "--mesh", "fsdp=2,model=2", "--stage", "grpo",
                         "--cost", "train step", "--attention", "splash")
    assert done.returncode == 0, done.stderr[-3000:]
    _, whole = smoke_plan
    step = lambda plan: next(p for s in plan["stages"] if s["stage"] == "grpo"  # noqa: E731
                             for p in s["programs"] if p["program"] == "train step")
    assert step(splash)["kernel_flops"] > 0 and step(whole)["kernel_flops"] == 0
    assert step(splash)["flops"] > step(splash)["kernel_flops"] and step(splash)["seconds"] > 0
    assert step(splash)["params"] == step(whole)["params"] and step(splash)["optimizer"] == step(whole)["optimizer"]


def test_a_preset_that_does_not_fit_is_refused_with_the_change_that_fits(tmp_path):
    """A 1.3B-parameter teacher replicated over 4 chips (data = 4) needs about 21 GB of weights,
    gradients and AdamW moments on each v5e chip of 16 GiB; FSDP over the same chips fits. (Its
    remat is `full` already, so the remedies tried are the mesh's: no microbatch count splits its
    4 rows further over 4 chips.)"""
    preset = tmp_path / "big.toml"
    preset.write_text(SMOKE.read_text().replace("[teacher]\nd_model = 32\nn_layers = 1\nn_heads = 2",
                                                "[teacher]\nd_model = 4096\nn_layers = 5\nn_heads = 32\nd_ff = 16384"
                                                "\nremat = \"full\"")
                      .replace("batch_size = 16", "batch_size = 4"))
    done, plan = _plan(tmp_path, preset, "--topology", "v5e:2x2", "--mesh", "data=4", "--stage", "sft",
                       "--cost", "none")  # the fit and the remedy need memory only, not the unrolled cost compile
    assert done.returncode == 1, done.stderr[-3000:]
    teacher = next(s for s in plan["stages"] if s["stage"] == "sft-teacher")
    assert not teacher["fits"] and teacher["peak"] > 16 * 2**30
    # The compiler refuses the train step; its arguments are the state's logical bytes (at least the
    # weights and AdamW moments), not 0, and its peak the total the compiler named.
    step = next(p for p in teacher["programs"] if p["program"] == "train step")
    required, available = refusal_bytes(step["refused"])
    assert step["memory_from"] == "logical" and step["peak"] == step["required"] == required
    assert step["argument"] >= step["params"] + step["optimizer"] > 15 * GiB and step["temp"] > 0
    assert step["argument"] + step["output"] - step["alias"] + step["temp"] == required
    assert available == CHIPS["v5e"].usable_hbm  # the chip table holds libtpu's own figure
    # A stage that cannot fit is not compiled further: its held-out decoding is left out, and said so.
    assert [p["program"] for p in teacher["programs"]][-1] == "train step"
    assert "sft-teacher: held-out decoding not compiled: the train step does not fit" in done.stderr
    assert "| sft-teacher | train step | 5.00 | 10.01 | 15.01 (logical) |" in done.stdout
    # `--cost none`: no program has FLOPs or a time.
    assert all(p["flops"] is None and p["seconds"] is None for s in plan["stages"] for p in s["programs"])
    assert teacher["remedy"].startswith("fits with [mesh] fsdp = 4, data = 1"), teacher["remedy"]
    assert "sft-teacher: peak" in done.stdout and "DOES NOT FIT: fits with [mesh] fsdp = 4" in done.stdout
    assert next(s for s in plan["stages"] if s["stage"] == "sft-student")["fits"]


def test_without_libtpu_the_plan_says_how_to_get_it(tmp_path):
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed in this environment")
    done = subprocess.run([sys.executable, "-m", "bd_train.plan", str(SMOKE), "--topology", "v5e:2x2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "make plan-env" in done.stderr


def _program(peak: int, **changes) -> ProgramPlan:
    figures = {"argument": peak, "output": 0, "alias": 0, "temp": 0, "code": 0, "params": peak // 3,
               "optimizer": 2 * (peak // 3), "flops": None, "bytes_accessed": None, "seconds": None}
    return ProgramPlan("grpo", "train step", **(figures | changes))


def _one_stage_plan(*programs: ProgramPlan) -> Plan:
    chip = CHIPS["v5e"]
    return Plan("tiny", "v5e:2x2", {"data": 4, "fsdp": 1, "model": 1}, 4, 1, chip.hbm, chip.peak_flops,
                [StagePlan("grpo", list(programs), chip.usable_hbm)], chip.usable_hbm)


def test_the_verdict_compares_against_the_hbm_libtpu_lets_a_program_use():
    """A stage whose peak lies between libtpu's 15.75 GiB and the chip's 16 GiB would be refused
    by the compiler: it does not fit; its figures not computed are empty cells, not 0."""
    between = _one_stage_plan(_program(int(15.9 * GiB)))
    assert not between.stages[0].fits and _one_stage_plan(_program(int(15.7 * GiB))).stages[0].fits
    text = format_plan(between)
    assert "grpo: peak 15.90 GiB of 15.75 GiB usable per chip: DOES NOT FIT" in text
    assert "| grpo | train step | 5.30 | 10.60 | 15.90 | 0.00 | 0.00 | 0.0 | 0.00 | 15.90 | 101% |  |  |  |" in text
    refused = _program(int(2 * GiB), temp=int(20 * GiB), memory_from="logical", required=int(22 * GiB),
                       refused="RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    assert "| 2.00 (logical) | 0.00 (logical) | 20.00 (rest) | 0.0 | 0.00 | 22.00 | 140% |" in format_plan(
        _one_stage_plan(refused))
    # A program that fits alone does not beside what the stage holds (an OPD teacher's weights).
    beside = _one_stage_plan(_program(int(12 * GiB), resident=int(4 * GiB)))
    assert not beside.stages[0].fits and beside.stages[0].peak == 16 * GiB
    assert "| 12.00 | 0.00 | 0.00 | 0.0 | 4.00 | 16.00 | 102% |" in format_plan(beside)
    costed = _program(GiB, flops=2e12, bytes_accessed=1e9, seconds=0.02, seconds_from="roofline", model_flops=1e12)
    assert "| 2 | >= 0.02 | <= 25% |" in format_plan(_one_stage_plan(costed))


def test_a_stage_too_large_is_offered_half_its_held_out_decodings_rows():
    """OPD on one chip: the held-out decoding, beside the teacher and the LoRA state, is the peak,
    which neither microbatches nor remat touch; halving its rows does. Not below one row per
    data-parallel chip."""
    from bd_train._plan_remedies import remedies_for

    config = {"eval": {"n": 512, "batch_size": 64}, "opd": {"prompts_per_step": 16, "microbatches": 4}}
    offered = [d for d, _, _ in remedies_for(config, "opd", {"data": 1, "fsdp": 1, "model": 1}, 1.1)]
    assert "[eval] batch_size = 32" in offered
    halved = next(c for d, c, _ in remedies_for(config, "opd", {"data": 1, "fsdp": 1, "model": 1}, 1.1)
                  if d.startswith("[eval]"))
    assert halved["eval"] == {"n": 512, "batch_size": 32} and config["eval"]["batch_size"] == 64
    small = {**config, "eval": {"n": 12, "batch_size": 64}}  # 12 problems over 8 chips: 6 rows is too few
    assert not any(d.startswith("[eval]") for d, _, _ in remedies_for(small, "opd", {"data": 8, "fsdp": 1,
                                                                                       "model": 1}, 1.1))


def test_the_exit_codes_are_documented():
    import bd_train.plan

    done = subprocess.run([sys.executable, "-m", "bd_train.plan", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0
    for doc in (done.stdout, bd_train.plan.__doc__ or "", LEGEND):
        assert "0" in doc and "1 a stage does not fit" in " ".join(doc.split()).replace("1  a", "1 a"), doc


def test_unknown_topologies_and_meshes_are_refused_by_name(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bd_train.plan", str(SMOKE), "--topology", "v9x:2x2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--topology 'v9x:2x2': expected <generation>:<shape>" in done.stderr
    for name in ("v5e:2x3", "v5e:4x2", "v6e:2x2x2", "v5p:2x2", "v5p:3x4x4", "v5p:4x4x6"):
        with pytest.raises(TopologyError, match=rf"--topology '{name}': v\d\w slices are not made in the shape"):
            parse_topology(name)
    for name in ("v5e:2x4", "v6e:16x16", "v5p:2x2x1", "v5p:2x2x4", "v5p:16x16x24", "v5p:4x8x12"):
        assert parse_topology(name)[1] == tuple(int(d) for d in name.split(":")[1].split("x"))
    if importlib.util.find_spec("libtpu") is None and not PLAN_PYTHON.exists():
        return
    done, _ = _plan(tmp_path, SMOKE, "--topology", "v5e:2x2", "--mesh", "fsdp=8")
    assert done.returncode == 2 and "data*fsdp*model = 1*8*1 = 8 but v5e:2x2 has 4 chips" in done.stderr


def test_flags_a_user_mistypes_are_refused_before_anything_compiles(capsys):
    from bd_train.plan import main

    for flags, message in ((["--mesh", "data=0,fsdp=4"], "each N >= 1"),
                           (["--mesh", "data=4,data=2"], "data is given twice; give each axis once"),
                           (["--largest-batch", "-1"], "--largest-batch -1: the doublings to try must be at least 1")):
        with pytest.raises(SystemExit) as exit_:
            main([str(SMOKE), "--topology", "v5e:2x2", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, flags


def test_a_batch_the_slice_cannot_split_is_planned_with_fewer_microbatches(tmp_path):
    """OPD's 8 prompts in 4 microbatches are 2 rows each, which 4 data-parallel chips cannot
    split: the stage is planned with 2 microbatches, and says so. `--cost "train step"` costs the
    scanned train step alone: no other program gets an estimated time. (`--streamed` adds the
    streamed step's programs, which no stage runs; without it they are not planned.)"""
    preset = tmp_path / "split.toml"
    preset.write_text(SMOKE.read_text().replace("[opd]\n", "[opd]\nmicrobatches = 4\n"))
    done, plan = _plan(tmp_path, preset, "--topology", "v5e:2x2", "--mesh", "data=4", "--stage", "opd",
                       "--no-remedies", "--cost", "train step", "--streamed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert plan["preset"] == "split.toml"
    opd = plan["stages"][0]
    assert opd["fits"] and opd["planned_with"].startswith("[opd] microbatches = 2 (as configured: [opd] "
                                                           "prompts_per_step = 8 in 4 microbatch(es) gives 2 rows")
    assert "planning it with [opd] microbatches = 2" in done.stderr and "planned with [opd]" in done.stdout
    programs = {p["program"]: p for p in opd["programs"]}
    assert {"teacher forward", "streamed step: accumulate", "streamed step: apply"} <= set(programs)
    costed = {"train step", "rollouts: one denoising step"}  # the step has no loop: it is its own twin
    assert {name for name, p in programs.items() if p["seconds"]} == costed
    assert {name for name, p in programs.items() if p["flops"] is not None} == costed


def test_the_mesh_given_replaces_the_presets_in_its_row_checks(tmp_path):
    """A preset made for fsdp 4 (SFT's 2 rows per microbatch do not split over it) planned for one
    chip with `--mesh fsdp=1`: its rows are checked against the mesh planned, in the plan and in
    every remedy (they were checked against the preset's `[mesh]`, which refused the plan, and
    every microbatch remedy, by the preset's 4 devices)."""
    preset = tmp_path / "four.toml"
    sft = "[sft]\nsteps = 6\nbatch_size = "
    preset.write_text(SMOKE.read_text().replace(sft + "16", sft + "4\nmicrobatches = 2") + "\n[mesh]\nfsdp = 4\n")
    done, plan = _plan(tmp_path, preset, "--topology", "v5e:1x1", "--mesh", "fsdp=1", "--stage", "sft",
                       "--no-remedies", "--cost", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert plan["mesh"] == {"data": 1, "fsdp": 1, "model": 1} and all(s["fits"] for s in plan["stages"])
    assert "devices must divide" not in done.stderr


def test_largest_batch_doubles_the_configured_batch_while_the_stage_fits(tmp_path):
    """`--largest-batch 1`: GRPO's prompts per step doubled (every program of the stage compiled for
    memory at each size) while the stage fits, up to 2^1 times the configured one; the smoke
    preset's tiny student fits 2x its batch. (Its peak need not grow at every doubling: XLA's buffer
    assignment at 8x was below the configured one's, at 16x above.)"""
    done, plan = _plan(tmp_path, SMOKE, "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--stage", "grpo",
                       "--no-remedies", "--cost", "none", "--largest-batch", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    configured = Run(parse_pipeline_config(SMOKE.read_text())).config.grpo.prompts_per_step
    found = plan["stages"][0]["largest_batch"]
    assert (found["setting"], found["batch"], found["capped"]) == ("[grpo] prompts_per_step", 2 * configured, True)
    assert found["train_step"]["seconds"] is None  # `--cost none`: memory only
    tried = [int(line.split("prompts_per_step = ")[1].split(":")[0]) for line in done.stderr.splitlines()
             if "grpo with [grpo] prompts_per_step = " in line]
    assert tried == [configured, 2 * configured]
    peaks = [float(line.split("peak ")[1].split(" GiB")[0]) for line in done.stderr.splitlines()
             if "grpo with [grpo] prompts_per_step = " in line]
    assert all(peak > 0 for peak in peaks)
    microbatches = Run(parse_pipeline_config(SMOKE.read_text())).config.grpo.microbatches
    assert (f"grpo: largest [grpo] prompts_per_step that fits at [grpo] microbatches = {microbatches}: "
            f"{2 * configured} (the largest size tried: more may fit); peak ") in done.stdout


def test_a_preset_of_hub_repo_ids_plans_before_the_weights_are_fetched(tmp_path, hub_cache):
    """`make plan` on a preset whose `pretrained` are Hub repo ids needs their config and tokenizer
    only: the Hub cache here holds the repo without its weights (offline), and the plan compiles."""
    repo = "bdlm-test/tiny-sdar"
    snapshot = hub_cache("sdar", repo, "a" * 40, weights=False)
    assert not list(snapshot.glob("*.safetensors"))
    preset = tmp_path / "hub.toml"
    preset.write_text(f'[task]\nname = "sort"\nparams = {{ length = 4 }}\n[canvas]\nprompt_len = 8\n'
                      f'max_new_tokens = 8\nblock_size = 4\n[teacher]\npretrained = "{repo}"\n'
                      f'[student]\npretrained = "{repo}"\n[sft]\nbatch_size = 8\n')
    done, plan = _plan(tmp_path, preset, "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--stage", "sft",
                       "--cost", "none", "--no-remedies")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["stage"] for s in plan["stages"]] == ["sft-teacher", "sft-student"]
    assert all(p["params"] > 0 for s in plan["stages"] for p in s["programs"] if p["program"] == "train step")


def test_approx_cost_extrapolates_twins_of_two_and_three_layers_with_the_flops_within_one_percent(tmp_path):
    """`--approx-cost` costs from twins of 2 and 3 layers, extrapolated to the model's, not from
    twins with every layer unrolled (a minute or more of compiling each for a released model): on
    a 6-layer preset planned for a v5p slice, every costed program of every stage (train steps,
    GRPO's streamed steps, OPD's teacher forward, GRPO's reference scoring) has the same memory and
    FLOPs within 1% of its fully unrolled twin's; bytes accessed and time are approximations, marked
    ~ in the table (here within 10%; for SDAR-1.7B's train steps on a v5p-16, bytes +5% to +24% and
    time +4% to +22%). (libtpu's cost model gives these tiny programs no time: the roofline's.)"""
    preset = tmp_path / "deep.toml"
    preset.write_text(SMOKE.read_text().replace("n_layers = 1", "n_layers = 6")
                      .replace("[grpo]\n", "[grpo]\nmicrobatches = 2\n"))
    script = ("import json, sys, tomllib\nfrom bd_train.plan import format_plan, plan\n"
              "data, memo = tomllib.loads(open(sys.argv[1]).read()), {}\n"
              "runs = [plan(data, 'v5p:2x2x1', mesh={'data': 1, 'fsdp': 2, 'model': 2}, remedies=False, memo=memo, "
              "approx_cost=approx, streamed=True) for approx in (True, False)]\n"
              "print(format_plan(runs[0]))\n"
              "open(sys.argv[2], 'w').write(json.dumps([run.to_json() for run in runs]))\n")
    out = tmp_path / "plans.json"
    done = subprocess.run([_python(), "-c", script, str(preset), str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    approx, exact = ({(s["stage"], p["program"]): p for s in plan["stages"] for p in s["programs"]}
                     for plan in json.loads(out.read_text()))
    assert approx.keys() == exact.keys()
    extrapolated = {key for key, p in approx.items() if p["extrapolated"]}
    assert {("grpo", "streamed step: accumulate"), ("grpo", "streamed step: apply"), ("grpo", "reference scoring"),
            ("opd", "teacher forward")} | {(s, "train step") for s in ("sft-teacher", "sft-student", "opd", "grpo")} \
        == extrapolated
    assert not any(p["extrapolated"] for p in exact.values())
    for key, p in approx.items():
        q = exact[key]
        assert (p["argument"], p["temp"], p["peak"]) == (q["argument"], q["temp"], q["peak"]), key
        if key in extrapolated:
            assert p["flops"] == pytest.approx(q["flops"], rel=0.01), key
            assert p["seconds_from"] == q["seconds_from"], key
            for figure in ("bytes_accessed", "seconds"):
                assert p[figure] == pytest.approx(q[figure], rel=0.1), (key, figure)
        else:
            assert p == q, key
    row = next(line for line in done.stdout.splitlines() if line.startswith("| grpo | train step |"))
    assert row.endswith("% |") and "~" in row.split("|")[-3] and "~" in row.split("|")[-2], row


def test_row_major_teacher_logits_spare_the_train_step_a_copy_of_them():
    """Where libtpu's default layout puts the rows of a chip's teacher logits in the lanes (a
    multiple of 128 rows, a vocabulary shard that is not), OPD's train step copies the whole
    argument back to row-major first; placed by `logits_format` it takes them as they are, and
    its temporaries are smaller by at least the copy."""
    done = subprocess.run([_python(), str(Path(__file__).with_name("plan_layout_probe.py"))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["default"]["layout"] != [0, 1, 2]
    assert probe["row_major"]["layout"] == [0, 1, 2]
    assert probe["row_major"]["temp"] <= probe["default"]["temp"] - probe["shard_bytes"]


def test_a_program_is_compiled_once_however_often_it_is_submitted():
    """The plan's compiler threads: the same StableHLO submitted again (by another stage, or while it
    compiles) shares one compile; a compile cancelled before it started is started again when asked
    for; another program gets its own. CPU programs stand in for the TPU's."""
    import concurrent.futures

    from bd_train._plan_compile import figures, submit

    x = jax.ShapeDtypeStruct((64, 64), np.float32)
    square = jax.jit(lambda a: a @ a).lower(x)
    memo: dict = {}
    first = submit(square, memo)
    assert submit(jax.jit(lambda b: b @ b).lower(x), memo) is first and len(memo) == 1
    assert figures(square, memo).memory[0] == 64 * 64 * 4  # the argument's bytes
    cancelled: concurrent.futures.Future = concurrent.futures.Future()
    cancelled.cancel()
    memo[next(iter(memo))] = cancelled
    again = submit(square, memo)
    assert again is not cancelled and again.result().memory == first.result().memory
    assert submit(jax.jit(lambda a: a + 1).lower(x), memo) is not again and len(memo) == 2
