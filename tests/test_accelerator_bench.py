"""`bench/accelerator.py` (the accelerator benchmark: bf16 train-step MFU, fused vs XLA attention) runs
end to end at its small size on CPU, so it is ready when a GPU is: every kernel's bfloat16 value
and gradients stay near float32 dense attention, and its BENCHMARKS.md section renders. The 1B
train step it times on a GPU lowers for CUDA here, its attention through three Triton kernels."""

import json
import math
import sys
from pathlib import Path

import equinox as eqx
import jax
import optax
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import accelerator  # noqa: E402  (bench/ is a folder of scripts, not a package)
import trace_replay  # noqa: E402
from train_step import make_step, sft_batch  # noqa: E402

from bd_models import BlockDiffusionLM  # noqa: E402


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
    assert "<!-- accelerator_cpu_small:start -->" in text and "Device: cpu" in text
    assert all(f"| `{impl}` |" in text for impl in ("dense", "blocked", "pallas"))


def test_1b_step_lowers_for_cuda_through_triton():
    """Shapes only (no 1B arrays are made): the whole jitted step at the benchmark's shapes."""
    config, batch, canvas, _ = accelerator.SIZES["1b"]
    config = config.replace(attention="pallas")
    model = eqx.filter_eval_shape(BlockDiffusionLM, config, key=jax.random.key(0))
    optimizer = optax.adamw(3e-4, weight_decay=0.01)
    opt_state = eqx.filter_eval_shape(optimizer.init, model)
    args = (model, opt_state, *sft_batch(config, batch, canvas))
    text = make_step(optimizer).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # the scanned layer's forward, dq and dk/dv kernels


@pytest.mark.parametrize("inputs", ["ops", "compiled"])
def test_plan_vs_device_runs_a_plans_program_and_renders(tmp_path, inputs):
    """`bench/plan_vs_device.py` builds the smoke preset's SFT step with the plan's own builder,
    compiles it for this host's device and runs it on inputs of its shapes (made op by op, or each
    by one compiled program); its planned peak holds at least its arguments and temporaries, and
    CPU, which keeps no allocator statistics, is said so."""
    import plan_vs_device

    result = plan_vs_device.measure("smoke", "sft-student", "train step", runs=1, peak_n=256, inputs=inputs)
    assert result["planned_bytes"] >= result["argument_bytes"] + result["temp_bytes"] > 0
    assert result["measured_peak_bytes"] is None and result["step_s"] > 0 and result["mfu"] > 0
    assert result["inputs"] == inputs and result["memory_stats"] == {}
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# benchmarks\n")
    plan_vs_device._write_table({"smoke/sft-student/train step/blocked": result}, markdown)
    text = markdown.read_text()
    assert "| smoke | sft-student | train step | `blocked` |" in text and "not kept by this device" in text


def test_a_tpus_reserved_bytes_are_read_beside_the_plan():
    """On a TPU the runtime reserves a program's temporaries apart from the bytes in use: the table
    shows the reserved peak, and the note sets arguments plus reserved against the plan."""
    import plan_vs_device

    GiB = 2**30
    row = {"device": "tpu: TPU v5 lite", "inputs": "compiled", "planned_bytes": 21 * GiB // 2,
           "argument_bytes": 3 * GiB, "temp_bytes": 7 * GiB, "measured_peak_bytes": 3 * GiB,
           "memory_stats": {"peak_bytes_in_use": 3 * GiB, "peak_bytes_reserved": 6 * GiB},
           "step_s": 0.4, "mfu": 0.5}
    rows = {"p/opd/train step/blocked, compiled inputs": row,
            "p/sft-student/train step/blocked": {**row, "inputs": "ops", "memory_stats": {}}}
    table = plan_vs_device.table(rows)
    assert ("| p | opd | train step | `blocked, compiled inputs` | 10.500 GiB | 3.000 GiB | -7680 MiB | 6.000 GiB |"
            in table)
    assert "| p | sft-student | train step | `blocked` | 10.500 GiB | 3.000 GiB | -7680 MiB |  |" in table
    note = plan_vs_device.tpu_note(rows)  # from the rows whose inputs one program made
    assert "(OPD)" in note and "(6.00 GiB) was 1.00-1.00 GiB below" in note and "1.50-1.50 GiB below the plan" in note
    assert plan_vs_device.tpu_note({"k/opd/train step/blocked": rows["p/sft-student/train step/blocked"]}) == ""


def test_trace_replay_measures_the_cpus_float32_replay_within_float_tolerance(tmp_path):
    """On a CPU float32 products are float32 at any precision: the script's drift is the tests'
    1e-5 (an accelerator's default precision is what it measures)."""
    drift = trace_replay.drift(trace_replay.SIZES["small"], "blocked", "default")
    assert drift["tokens"] == trace_replay.ROWS * trace_replay.NEW and 0 <= drift["max_abs"] <= 1e-5
    assert drift["mean_abs"] <= drift["max_abs"] and drift["mean_logprob"] < 0


def test_a_devices_chip_is_read_from_its_kind():
    """`device_chip` maps JAX's `device_kind` to the plan's figures (a v5e reports "TPU v5 lite"),
    and answers None for a device that is no TPU the plan knows."""
    from bd_train.plan import device_chip

    kind = lambda name: type("Device", (), {"device_kind": name})()  # noqa: E731
    v5e, v6e = device_chip(kind("TPU v5 lite")), device_chip(kind("TPU v6 lite"))
    assert (v5e.name, v5e.hbm_bandwidth, v5e.peak_flops) == ("v5e", 819e9, 197e12) and v6e.name == "v6e"
    assert device_chip(jax.devices("cpu")[0]) is None and device_chip(kind("NVIDIA H200")) is None


def test_stages_on_device_writes_a_loadable_checkpoint_and_renders_a_failed_stage(tmp_path, capsys):
    """`bench/stages_on_device.py`'s parts that need no accelerator: the random checkpoint of the
    preset's layout (toy sizes here) reads back with its tokenizer's special tokens; the chain's
    preset parses; a stage that ran out of memory is a row of the table, not a lost result."""
    import tomllib

    import stages_on_device as sod

    from bd_models import from_pretrained
    from bd_train.stages import parse_pipeline_config, pipeline_config

    preset = tomllib.loads(sod.ONE_CHIP.read_text())
    raw = sod.write_checkpoint(preset, tmp_path / "checkpoint", shrink=True)
    model = from_pretrained(tmp_path / "checkpoint")
    assert model.config.vocab_size == sod.SHRUNK["vocab_size"] and model.config.n_layers == 2
    assert raw["mask_token_id"] == 287 and raw["eos_token_id"] == 289  # the ChatML fixture's ids
    data = sod.chain_preset(preset, tmp_path / "checkpoint", tmp_path / "runs", steps=3, eval_n=8)
    config = pipeline_config(parse_pipeline_config(data))
    assert (config.sft.steps, config.grpo.steps, config.eval.n) == (3, 3, 8)
    assert config.opd.microbatches == preset["opd"]["microbatches"]  # the preset's batches are kept
    splash = pipeline_config(parse_pipeline_config(sod.chain_preset(
        preset, tmp_path / "checkpoint", tmp_path / "runs", steps=3, eval_n=8, attention="splash")))
    assert splash.teacher.attention == splash.student.attention == "splash"
    run = {"sft-teacher": {"first_step_s": 20.0, "step_s": 0.6, "updates": 3, "eval_s": 30.0, "nfe_per_token": 1.0},
           "peak_bytes": 15 * 2**30, "memory_stats": {"peak_bytes_reserved": 6 * 2**30}}
    run["sft-student"] = run["sft-teacher"]
    table = sod.table({"sft": run, "opd": {"failed": "ValueError: RESOURCE_EXHAUSTED", "peak_bytes": None},
                       "plan": {"sft-teacher": {"peak": 11 * 2**30, "train_step_s": 0.36}}})
    assert "| sft-teacher | 20.0 | 0.60 | 0.36 | 30.0 | 1.00 | 15.00 | 6.00 | 11.00 |" in table
    assert "| opd | failed: ValueError: RESOURCE_EXHAUSTED |" in table
    # a later stage with another --attention than the chain's first would file its results wrongly
    (tmp_path / "preset.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        sod.main(["--stage", "opd", "--attention", "splash", "--work", str(tmp_path)])
    assert f"--attention splash but {tmp_path} holds a chain run with None" in capsys.readouterr().err
    assert not (tmp_path / "opd.json").exists()


def test_rollouts_on_device_counts_what_the_sampler_runs_and_renders():
    """`bench/rollouts_on_device.py` at its small size on a CPU: every row makes the forward passes
    the roofline counts (the sampler's own NFE); a pass's FLOPs are the model's count of its
    positions plus attention over the whole cache, its bytes the model's weights, the cache and the
    logits; the section renders a batch, one that did not fit, and the step's parts."""
    import rollouts_on_device as rod

    from bd_models import model_flops

    config, rows, cache, b = rod.SMALL, 3, 100, rod.SMALL.block_size
    flops, nbytes = rod.pass_cost(config, rows, b, cache, head=True)
    attention = config.n_layers * config.n_heads * rows * b * cache * 4 * config.head_dim
    assert flops == model_flops(config, (rows, b))["matmul_forward"] + attention
    head = rows * b * 2 * config.d_model * config.vocab_size
    assert flops - rod.pass_cost(config, rows, b, cache, head=False)[0] == head
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(BlockDiffusionLM(config, key=jax.random.key(0)),
                                                                eqx.is_array)))
    kv = 2 * config.n_layers * rows * config.n_kv_heads * config.head_dim * cache * 2  # bfloat16 keys and values
    kv_and_logits = kv + rows * b * config.vocab_size * 4
    assert abs(nbytes - kv_and_logits - weights) <= 0.01 * weights  # the norms' scales are not counted

    result = rod.run("small", [2], parts_at=[2])
    row, part = result["batches"]["2"], result["parts"]["2"]
    assert row["nfe"] == [sum(rod.forward_passes().values())] == [1 + 128] and row["tokens_per_s"] > 0
    assert part["step_s"] > 0 and part["forward_s"] > 0 and part["step_flops"] > 0
    result["batches"]["512"] = {"failed": "RESOURCE_EXHAUSTED: Ran out of memory on HBM"}
    result["device"] = "tpu: TPU v5 lite"  # a chip whose published figures give a second roofline
    text = rod.table(result)
    assert "197 TFLOP/s, 819 GB/s" in text and "| 512 | does not fit: RESOURCE_EXHAUSTED" in text
    assert text.count("\n| 2 | ") == 2  # the batch's row and its parts' row
