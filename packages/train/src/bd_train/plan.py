"""Ahead-of-time plans: every program a pipeline stage runs, built from shapes on a TPU slice's
devices and compiled for TPU from this host, which need not have one (libtpu's compiler only).

    python -m bd_train.plan flows/configs/sdar_8b.toml --topology v5p:2x2x2 [--stage all] [--num-slices 1]
        [--mesh data=1,fsdp=8,model=1] [--json plan.json]

Per stage (SFT of each role, OPD, GRPO) it compiles the train step (and, with `microbatches` > 1,
the streamed step's two programs), the sampler's programs (rollouts, held-out decoding), the
teacher's forward for OPD and the reference scoring for GRPO (`beta` > 0). Per chip it prints
parameter, optimizer-state, argument, temporary and generated-code bytes against the chip's HBM;
the compiler's FLOPs and estimated seconds (its cost model, not a timing) and from them the
estimated MFU (model matmul FLOPs over the chip's bf16 peak). A stage that does not fit is
re-planned with single changes — remat `full`, more microbatches, `fsdp` over the data axis,
LoRA — and the first that fits is named. No weights, data or tokenizer files are read: model
shapes come from the preset (or a pretrained folder's config.json), data shapes from the canvas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bd_core import ConfigError, DiffusionTokenBatch, DistillationBatch, ViewLayout, as_loss_output
from bd_models import (
    BlockDiffusionLM,
    MeshError,
    ModelConfig,
    SamplerConfig,
    SamplingDistribution,
    add_lora,
    batch_sharding,
    check_divisibility,
    lower,
    lower_sample,
    model_config_from_hf,
    model_flops,
    param_partition_specs,
    read_hf_config,
    token_logprobs,
    unroll_layers,
)

from ._grpo import GRPOBatch, distribution_score, make_grpo_loss
from ._opd import OPDConfig, make_opd_loss
from ._optim import make_optimizer
from ._replay import replay_capacity
from ._sft import sft_objective
from ._tpu import GiB, Topology, TopologyError, topology
from ._trainer import Trainer, TrainerConfig, TrainState

STAGES = ("sft", "opd", "grpo")


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One compiled program, per chip: bytes of its arguments (of which `params` are model
    weights and `optimizer` optimizer state), outputs, aliased buffers, temporaries and generated
    code; the compiler's FLOPs and estimated seconds; the model's matmul FLOPs (train steps)."""

    stage: str
    program: str
    argument: int
    output: int
    alias: int
    temp: int
    code: int
    params: int
    optimizer: int
    flops: float
    bytes_accessed: float
    seconds: float | None
    seconds_from: str = ""  # "xla": the compiler's estimate; "roofline": max(FLOPs / peak, bytes / bandwidth)
    model_flops: float | None = None
    refused: str | None = None  # the TPU compiler's own out-of-memory message: the program cannot run there

    @property
    def peak(self) -> int:
        """Bytes live at once on a chip: inputs, outputs (less what they alias), temporaries, code."""
        return self.argument + self.output - self.alias + self.temp + self.code


@dataclasses.dataclass
class StagePlan:
    stage: str
    programs: list[ProgramPlan]
    hbm: int
    remedy: str | None = None  # for a stage that does not fit: the first single change that fits

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm and not any(p.refused for p in self.programs)


@dataclasses.dataclass
class Plan:
    preset: str
    topology: str
    mesh: dict[str, int]
    chips: int
    hosts: int
    hbm: int
    peak_flops: float
    stages: list[StagePlan]

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.preset, "topology": self.topology, "mesh": self.mesh, "chips": self.chips,
                "hosts": self.hosts, "hbm": self.hbm, "peak_flops": self.peak_flops,
                "stages": [{"stage": s.stage, "fits": s.fits, "peak": s.peak, "remedy": s.remedy,
                            "programs": [{**dataclasses.asdict(p), "peak": p.peak} for p in s.programs]}
                           for s in self.stages]}


# -- shapes ---------------------------------------------------------------------------------------

def _sds(shape: tuple[int, ...], dtype: Any) -> Any:
    """A shape, typed `Any`: it stands where the contracts hold arrays."""
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _layout(rows: int, length: int) -> ViewLayout:
    ints = [_sds((rows, length), jnp.int32) for _ in range(4)]
    return ViewLayout(ints[0], ints[1], ints[2], ints[3], _sds((rows, length), jnp.bool_))


def diffusion_batch(rows: int, length: int) -> DiffusionTokenBatch:
    """A `DiffusionTokenBatch` of `rows` x `length` as shapes (the data pipelines' dtypes)."""
    return DiffusionTokenBatch(_layout(rows, length), _sds((rows, length), jnp.int32),
                               _sds((rows, length), jnp.float32), _sds((rows, length), jnp.float32))


def place_batch(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shapes with the data pipelines' placement: leading axis over (`data`, `fsdp`)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=batch_sharding(mesh) if x.ndim else NamedSharding(mesh, P())), tree)


def place_state(tree: Any, model: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shapes of `tree` (a model, or a train state holding `model`) with the stages' placement:
    every weight by `param_partition_specs`, every optimizer moment or accumulated gradient like
    the weight it mirrors (found by path), anything else replicated."""
    specs = jax.tree_util.tree_flatten_with_path(param_partition_specs(model, mesh),
                                                 is_leaf=lambda x: isinstance(x, P))[0]
    shapes = {tuple(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
    by_path = {tuple(path): spec for path, spec in specs}

    def place(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        spec = P()
        for start in range(len(path)):
            suffix = tuple(path[start:])
            if suffix in by_path and shapes[suffix] == leaf.shape:
                spec = by_path[suffix]
                break
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, tree)


def _bytes_per_chip(tree: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
            total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    return total


# -- what the preset builds -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Shapes:
    """The preset's models and decoding as shapes: no tokenizer file or weights are needed."""

    config: Any  # PipelineConfig
    models: dict[str, ModelConfig]
    mask_id: int
    pad_id: int
    eos_id: int

    @classmethod
    def of(cls, config: Any) -> _Shapes:
        from .stages._run import Run

        run = Run(config)
        cfg = run.config
        folder = next((getattr(cfg, r).pretrained for r in ("student", "teacher") if getattr(cfg, r).pretrained), None)
        tokenizer_file = cfg.tokenizer.path or (str(Path(folder) / "tokenizer.json") if folder else None)
        if tokenizer_file is None or Path(tokenizer_file).is_file():
            tok = run.tokenizer
            models = {role: run.model_config(role) for role in ("teacher", "student")}
            return cls(cfg, models, tok.mask_id, tok.pad_id, tok.eos_id)
        # A pretrained folder holding config.json only (a plan before the weights are fetched):
        # the vocabulary and special ids come from the config.
        assert folder is not None
        models = {}
        for role in ("teacher", "student"):
            section = getattr(cfg, role)
            raw = read_hf_config(section.pretrained or folder)
            kwargs = section.model_kwargs()
            models[role] = model_config_from_hf(
                raw, where=str(Path(section.pretrained or folder) / "config.json"), block_size=cfg.canvas.block_size,
                vocab_size=int(raw["vocab_size"]) + int(cfg.tokenizer.add_mask_token),
                **{k: kwargs[k] for k in ("param_dtype", "compute_dtype", "attention", "remat")})
        raw = read_hf_config(folder)
        vocab = models["student"].vocab_size
        eos = raw.get("eos_token_id", 0)
        eos = int(eos[0] if isinstance(eos, list) else eos)
        mask = int(raw.get("mask_token_id", vocab - 1))
        pad = raw.get("pad_token_id")  # ids only shape nothing: any id the sampler may not emit will do
        if pad in (None, eos, mask):
            pad = next(i for i in range(vocab - 1, 0, -1) if i not in (eos, mask))
        return cls(cfg, models, mask, int(pad), eos)

    def sampler(self, section: Any) -> SamplerConfig:
        canvas = self.config.canvas
        return SamplerConfig(block_size=canvas.block_size, max_new_tokens=canvas.max_new_tokens, mask_id=self.mask_id,
                             pad_id=self.pad_id, distribution=SamplingDistribution(temperature=section.temperature,
                                                                                   top_k=section.top_k,
                                                                                   top_p=section.top_p),
                             strategy=section.strategy, threshold=section.threshold,
                             steps_per_block=section.steps_per_block,
                             max_steps_per_block=section.max_steps_per_block, confidence=section.confidence,
                             stop_ids=(self.eos_id,))

    def make_model(self, role: str, stage: str) -> Callable[[], Any]:
        """What the stage trains or runs for `role`, to build under `eval_shape`: the model, with
        fresh LoRA adapters where `[role] lora` names the stage."""
        section = getattr(self.config, role)
        lora = section.lora.lora_config() if section.lora is not None and stage in section.lora.stages else None
        config = self.models[role]

        def make():
            model = BlockDiffusionLM(config, key=jax.random.key(0))
            return model if lora is None else add_lora(model, lora, key=jax.random.key(1))

        return make


# -- programs -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Program:
    """A lowered program; `cost` (with its multiplicity) is the same computation with the layers
    unrolled, lowered only for XLA's cost analysis, which counts a loop body once."""

    stage: str
    program: str
    lowered: Any
    params: int = 0
    optimizer: int = 0
    model_flops: float | None = None
    cost: tuple[Any, int] | None = None


def _train_programs(stage: str, trainer: Trainer, make: Callable[[], Any], batch: Any, mesh: jax.sharding.Mesh,
                    model_config: ModelConfig, tokens: tuple[int, int], microbatches: int = 1,
                    cost: bool = True) -> list[_Program]:
    """The scanned train step, and with `microbatches` > 1 the streamed step's two programs;
    `cost=False` skips the unrolled programs that only serve the cost estimate."""
    abstract = eqx.filter_eval_shape(lambda: TrainState.init(make(), trainer.optimizer, key=jax.random.key(0)))
    state = place_state(abstract, abstract.model, mesh)
    flops = 3 * model_flops(model_config, tokens)["matmul_forward"] / mesh.size
    params, optimizer = _bytes_per_chip(state.model), _bytes_per_chip(state.opt_state)
    # For the cost: one microbatch's step with the layers unrolled (the microbatch scan and the
    # layer scan are loops whose bodies XLA's cost analysis counts once), times the microbatches.
    micro = jax.tree.map(lambda x: _sds((x.shape[0] // microbatches, *x.shape[1:]), x.dtype), batch)
    one = Trainer(trainer.loss_fn, trainer.optimizer)
    with unroll_layers():
        costed = (one.lower(state, place_batch(micro, mesh)), microbatches) if cost else None
    out = [_Program(stage, "train step", trainer.lower(state, place_batch(batch, mesh)), params, optimizer, flops,
                    costed)]
    if microbatches > 1:
        streaming = Trainer(trainer.loss_fn, trainer.optimizer, TrainerConfig(streaming=True))
        like = jax.eval_shape(lambda: as_loss_output(streaming.loss_fn(
            make(), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), micro), jax.random.key(0))))
        abstract = eqx.filter_eval_shape(lambda: TrainState.init(make(), trainer.optimizer, key=jax.random.key(0),
                                                                 streaming=True, like=like))
        state = place_state(abstract, abstract.model, mesh)
        for update, name in ((False, "streamed step: accumulate"), (True, "streamed step: apply")):
            lowered = streaming.lower(state, place_batch(micro, mesh), is_update_step=update)
            with unroll_layers():
                costed = (streaming.lower(state, place_batch(micro, mesh), is_update_step=update), 1) if cost else None
            out.append(_Program(stage, name, lowered, params, optimizer, flops / microbatches, costed))
    return out


def _sampler_program(stage: str, name: str, make: Callable[[], Any], sampler: SamplerConfig, rows: int,
                     prompt_len: int, mesh: jax.sharding.Mesh) -> _Program:
    abstract = eqx.filter_eval_shape(make)
    model = place_state(abstract, abstract, mesh)
    tokens, valid = place_batch((_sds((rows, prompt_len), jnp.int32), _sds((rows, prompt_len), jnp.bool_)), mesh)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    return _Program(stage, name, lower_sample(model, tokens, valid, sampler, key=key), _bytes_per_chip(model))


def _rows(rows: int, mesh: jax.sharding.Mesh) -> int:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    return -(-rows // shards) * shards


def stage_programs(shapes: _Shapes, stage: str, mesh: jax.sharding.Mesh, *, cost: bool = True) -> list[_Program]:
    """Every program `stage` ("sft-teacher", "sft-student", "opd" or "grpo") compiles (and, with
    `cost`, the unrolled twins its cost estimates come from)."""
    from .stages._rollout import grpo_config
    from .stages._run import Run

    cfg, canvas = shapes.config, shapes.config.canvas
    context = canvas.prompt_len + canvas.max_new_tokens
    eval_sampler = shapes.sampler(cfg.eval.sampler)
    eval_rows = _rows(min(cfg.eval.batch_size, cfg.eval.n), mesh)
    if stage.startswith("sft-"):
        role = stage.removeprefix("sft-")
        sft, model_config = cfg.sft, shapes.models[role]
        check_divisibility(model_config, mesh, sft.batch_size // sft.microbatches)
        length = context + canvas.max_new_tokens * sft.corruption.views
        optimizer = make_optimizer(Run.optimizer_config(sft.optim, sft.steps_for(role)))
        trainer = Trainer(sft_objective, optimizer, TrainerConfig(microbatches=sft.microbatches))
        make = shapes.make_model(role, "sft")
        programs = _train_programs(stage, trainer, make, diffusion_batch(sft.batch_size, length), mesh, model_config,
                                   (sft.batch_size, length), sft.microbatches, cost)
        return programs + [_sampler_program(stage, "held-out decoding", make, eval_sampler, eval_rows,
                                            canvas.prompt_len, mesh)]
    student = shapes.models["student"]
    section = cfg.opd if stage == "opd" else cfg.grpo
    sampler = shapes.sampler(section.sampler)
    rows = section.prompts_per_step * (cfg.grpo.group_size if stage == "grpo" else 1)
    check_divisibility(student, mesh, rows // section.microbatches)
    length = context + replay_capacity(sampler) * canvas.block_size
    replay = diffusion_batch(rows, length)
    make = shapes.make_model("student", stage)
    optimizer = make_optimizer(Run.optimizer_config(section.optim, section.steps))
    programs = [_sampler_program(stage, "rollouts", make, sampler, rows, canvas.prompt_len, mesh)]
    if stage == "opd":
        teacher_make = shapes.make_model("teacher", "opd")
        teacher = eqx.filter_eval_shape(teacher_make)
        logits = jax.eval_shape(lambda: teacher_make()(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                                                   replay.layout)))
        placed, layout = place_state(teacher, teacher, mesh), place_batch(replay.layout, mesh)
        forward = lambda t, layout: t(layout)  # noqa: E731
        with unroll_layers():
            costed = (lower(forward, placed, layout), 1) if cost else None
        programs.append(_Program(stage, "teacher forward", lower(forward, placed, layout), _bytes_per_chip(placed),
                                 cost=costed))
        loss = make_opd_loss(OPDConfig(temperature=section.kl_temperature, hard_ce_weight=section.hard_ce_weight,
                                       positions=section.positions, mask_id=shapes.mask_id))
        batch = DistillationBatch(replay, _sds(logits.shape, logits.dtype))
    else:
        run = Run(cfg)
        distribution = sampler.distribution
        ref = _sds((rows, length), jnp.float32) if section.beta > 0 else None
        if ref is not None:
            reference = eqx.filter_eval_shape(make)
            placed = place_state(reference, reference, mesh)
            score = lambda m, b: token_logprobs(m, b, distribution)[0]  # noqa: E731
            with unroll_layers():
                costed = (lower(score, placed, place_batch(replay, mesh)), 1) if cost else None
            programs.append(_Program(stage, "reference scoring", lower(score, placed, place_batch(replay, mesh)),
                                     _bytes_per_chip(placed), cost=costed))
        loss = make_grpo_loss(grpo_config(run), distribution_score(distribution))
        batch = GRPOBatch(replay, _sds((rows, length), jnp.float32), _sds((rows,), jnp.float32), ref)
    trainer = Trainer(loss, optimizer, TrainerConfig(microbatches=section.microbatches))
    programs += _train_programs(stage, trainer, make, batch, mesh, student, (rows, length), section.microbatches,
                                cost)
    programs.append(_sampler_program(stage, "held-out decoding", make, eval_sampler, eval_rows, canvas.prompt_len,
                                     mesh))
    return programs


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    return (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})


def _refused(program: _Program, message: str) -> ProgramPlan:
    """A program the TPU compiler would not build for lack of HBM ("Ran out of memory on HBM, the
    total memory required for HLO temporaries (37.80G) exceeds available HBM (15.75G)"): its
    temporaries are the sizes named."""
    line = next((s.strip() for s in message.splitlines() if "RESOURCE_EXHAUSTED" in s), message.strip())
    line = line[line.index("RESOURCE_EXHAUSTED"):]
    found = re.search(r"\(([\d.]+)([KMGT])\)", line)
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = int(float(found.group(1)) * scale[found.group(2)]) if found else 0
    return ProgramPlan(program.stage, program.program, 0, 0, 0, temp, 0, program.params, program.optimizer, 0.0, 0.0,
                       None, "", program.model_flops, refused=line)


def compile_program(program: _Program, chip: Any) -> ProgramPlan:
    """Compile for memory (the program as it runs) and for cost (`program.cost`: XLA counts a
    loop body once, so the sampler's figures are one pass of its loops and carry no time). The
    time is XLA's estimate where its TPU cost model gives one, else the roofline bound from its
    FLOPs and bytes accessed against the chip's peak and HBM bandwidth."""
    try:
        compiled = program.lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return _refused(program, str(err))
    memory = compiled.memory_analysis()
    seconds, source = None, ""
    if program.cost is not None:
        lowered, times = program.cost
        cost = _cost(lowered.compile())
        flops, accessed = times * float(cost.get("flops", 0.0)), times * float(cost.get("bytes accessed", 0.0))
        if cost.get("optimal_seconds", -1.0) > 0:  # negative: the cost model has no estimate
            seconds, source = times * float(cost["optimal_seconds"]), "xla"
        else:
            seconds, source = max(flops / chip.peak_flops, accessed / chip.hbm_bandwidth), "roofline"
    else:
        cost = _cost(compiled)
        flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    return ProgramPlan(program.stage, program.program, int(memory.argument_size_in_bytes),
                       int(memory.output_size_in_bytes), int(memory.alias_size_in_bytes),
                       int(memory.temp_size_in_bytes), int(memory.generated_code_size_in_bytes), program.params,
                       program.optimizer, flops, accessed, seconds, source, program.model_flops)


# -- meshes, remedies and the plan -----------------------------------------------------------------

def make_plan_mesh(mesh: dict[str, int], topo: Topology) -> jax.sharding.Mesh:
    """The preset's (`data`, `fsdp`, `model`) mesh laid over the slice's chips; across slices the
    `data` axis spans them (the slow links carry only the gradient all-reduce)."""
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    shape = (mesh["data"], mesh["fsdp"], mesh["model"])
    if int(np.prod(shape)) != topo.chips:
        raise ConfigError(f"mesh: data*fsdp*model = {'*'.join(map(str, shape))} = {int(np.prod(shape))} but "
                          f"{topo.name}{' x ' + str(topo.num_slices) if topo.num_slices > 1 else ''} has "
                          f"{topo.chips} chips; give --mesh data=...,fsdp=...,model=... with that product")
    if topo.num_slices > 1:
        if shape[0] % topo.num_slices:
            raise ConfigError(f"mesh: data = {shape[0]} must be a multiple of the {topo.num_slices} slices (the "
                              "data axis spans them); raise data or give fewer slices")
        ici = (shape[0] // topo.num_slices, shape[1], shape[2])
        devices = mesh_utils.create_hybrid_device_mesh(ici, (topo.num_slices, 1, 1), devices=list(topo.devices))
    else:
        devices = mesh_utils.create_device_mesh(shape, devices=list(topo.devices))
    return Mesh(devices, ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)


def _stage_names(config: Any, which: str) -> list[str]:
    names = []
    if which in ("sft", "all"):
        names += [f"sft-{role}" for role in ("teacher", "student") if not getattr(config, role).checkpoint]
    return names + [s for s in ("opd", "grpo") if which in (s, "all")]


def plan_stage(config: Any, stage: str, mesh_shape: dict[str, int], topo: Topology,
               log: Callable[[str], None] = lambda _: None, *, cost: bool = True) -> StagePlan:
    mesh = make_plan_mesh(mesh_shape, topo)
    shapes = _Shapes.of(config)
    programs = []
    for program in stage_programs(shapes, stage, mesh, cost=cost):
        log(f"  compiling {stage}: {program.program} ...")
        programs.append(compile_program(program, topo.chip))
    return StagePlan(stage, programs, topo.chip.hbm)


def _remedies(config: dict, stage: str, mesh: dict[str, int], over: float) -> list[tuple[str, dict, dict[str, int]]]:
    """Single changes that cut a stage's memory, as (description, changed config data, mesh), for
    a stage `over` times too large: more microbatches (the smallest count that might fit, then
    twice it), remat `full`, `fsdp` over the data axis, LoRA."""
    role = stage.removeprefix("sft-") if stage.startswith("sft-") else "student"
    out = []

    def changed(section: str, **values: Any) -> dict:
        data = json.loads(json.dumps(config))
        data.setdefault(section, {}).update(values)
        return data

    name = "sft" if stage.startswith("sft-") else stage
    section = config.get(name, {})
    defaults = {"sft": (128, 1), "opd": (64, 1), "grpo": (16, 8)}[name]
    rows = section.get("batch_size" if name == "sft" else "prompts_per_step", defaults[0])
    rows *= section.get("group_size", defaults[1]) if name == "grpo" else 1
    k, shards = section.get("microbatches", 1), mesh["data"] * mesh["fsdp"]
    valid = [m for m in range(k + 1, rows + 1) if rows % m == 0 and (rows // m) % shards == 0]
    first = next((m for m in valid if m >= k * over), valid[-1] if valid else None)
    for more in [m for m in valid if m >= (first or 0)][:2]:
        out.append((f"[{name}] microbatches = {more}", changed(name, microbatches=more), mesh))
    if config.get(role, {}).get("remat", "elementwise") != "full":
        out.append((f'[{role}] remat = "full"', changed(role, remat="full"), mesh))
    if mesh["data"] > 1:
        folded = {"data": 1, "fsdp": mesh["data"] * mesh["fsdp"], "model": mesh["model"]}
        out.append((f"[mesh] fsdp = {folded['fsdp']}, data = 1", config, folded))
    lora = config.get(role, {}).get("lora")
    if lora is None and (name != "sft" or config.get(role, {}).get("pretrained")):
        adapters = {"rank": 16, "alpha": 32.0, "targets": ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"],
                    "stages": [name]}
        out.append((f"[{role}] lora = {{rank = 16, all seven projections, stages = [\"{name}\"]}}",
                    changed(role, lora=adapters), mesh))
    return out


def plan(data: dict, topology_name: str, *, name: str = "preset", stage: str = "all", num_slices: int = 1,
         mesh: dict[str, int] | None = None, remedies: bool = True,
         log: Callable[[str], None] = lambda _: None) -> Plan:
    """Compile every program of the preset `data` (its TOML as a dict) for `topology_name`."""
    from .stages._config import parse_pipeline_config, pipeline_config

    topo = topology(topology_name, num_slices=num_slices)
    config = pipeline_config(parse_pipeline_config(data))
    mesh_shape = mesh or {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "model": config.mesh.model}
    log(f"{topo.describe()}; mesh {mesh_shape}")
    stages = []
    for name in _stage_names(config, stage):
        result = plan_stage(config, name, mesh_shape, topo, log)
        if not result.fits and remedies:
            result.remedy = "no single change tried makes it fit"
            over = result.peak / (0.9 * topo.chip.hbm)
            for description, changed, changed_mesh in _remedies(data, name, mesh_shape, over):
                log(f"  {name} does not fit ({result.peak / GiB:.1f} GiB): trying {description}")
                try:
                    retry = plan_stage(pipeline_config(parse_pipeline_config(changed)), name, changed_mesh, topo, log,
                                       cost=False)  # whether it fits: memory only
                except (ConfigError, MeshError) as err:
                    log(f"    not possible: {err}")
                    continue
                if retry.fits:
                    result.remedy = f"fits with {description} (peak {retry.peak / GiB:.2f} GiB per chip)"
                    break
        stages.append(result)
    return Plan(name, topology_name + (f" x {num_slices}" if num_slices > 1 else ""),
                mesh_shape, topo.chips, topo.hosts * num_slices, topo.chip.hbm, topo.chip.peak_flops, stages)


def format_plan(result: Plan) -> str:
    def gib(n: float) -> str:
        return f"{n / GiB:.2f}"

    lines = [f"{result.preset} on {result.topology}: {result.chips} chips over {result.hosts} host(s), mesh "
             f"{result.mesh}; per chip: {result.hbm / GiB:.0f} GiB HBM, {result.peak_flops / 1e12:.0f} TFLOP/s bf16",
             "", "| stage | program | params GiB | optimizer GiB | arguments GiB | temp GiB | code MiB | peak GiB | "
             "% of HBM | TFLOP/chip | est. s | est. MFU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage in result.stages:
        for p in stage.programs:
            mfu = (f"{100 * p.model_flops / (p.seconds * result.peak_flops):.0f}%"
                   if p.model_flops and p.seconds else "")
            lines.append(f"| {p.stage} | {p.program} | {gib(p.params)} | {gib(p.optimizer)} | {gib(p.argument)} | "
                         f"{gib(p.temp)} | {p.code / 2**20:.1f} | {gib(p.peak)} | {100 * p.peak / result.hbm:.0f}% | "
                         f"{p.flops / 1e12:.3g} | {_seconds(p)} | {mfu} |")
    lines.append("")
    for stage in result.stages:
        for p in stage.programs:
            if p.refused:
                lines.append(f"{stage.stage}: {p.program}: the TPU compiler refuses it: {p.refused}")
        verdict = "fits" if stage.fits else f"DOES NOT FIT: {stage.remedy}"
        lines.append(f"{stage.stage}: peak {gib(stage.peak)} GiB of {result.hbm / GiB:.0f} GiB per chip: {verdict}")
    lines.append("\nBytes and FLOPs are XLA's for the compiled TPU programs (a sampler's FLOPs: one pass of its "
                 "loops); est. s is XLA's cost model where it gives one, else (marked >=) the roofline bound "
                 "max(FLOPs / peak, bytes accessed / HBM bandwidth): estimates, not timings. est. MFU = the model's "
                 "matmul FLOPs per chip (3x forward) / (est. s x peak).")
    return "\n".join(lines)


def _seconds(p: ProgramPlan) -> str:
    if p.seconds is None:
        return ""
    return (">= " if p.seconds_from == "roofline" else "") + f"{p.seconds:.3g}"


def _mesh_arg(text: str) -> dict[str, int]:
    out = {"data": 1, "fsdp": 1, "model": 1}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in out or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected data=N,fsdp=N,model=N (any of them)")
        out[key.strip()] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bd_train.plan", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("preset", help="a preset TOML (flows/configs/<name>.toml)")
    parser.add_argument("--topology", required=True, help="e.g. v5e:2x4, v5p:2x2x2, v6e:4x4")
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    parser.add_argument("--mesh", type=_mesh_arg, default=None, help="data=N,fsdp=N,model=N (default: the preset's)")
    parser.add_argument("--no-remedies", action="store_true", help="do not re-plan a stage that does not fit")
    parser.add_argument("--json", default=None, help="also write the plan as JSON here")
    args = parser.parse_args(argv)
    path = Path(args.preset)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        print(f"plan: cannot read the preset {path}: {err}", file=sys.stderr)
        return 2
    try:
        result = plan(data, args.topology, name=path.name, stage=args.stage, num_slices=args.num_slices,
                      mesh=args.mesh, remedies=not args.no_remedies,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    except (TopologyError, ConfigError, MeshError) as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return 0 if all(s.fits for s in result.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
