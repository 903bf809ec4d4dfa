"""The programs of an ahead-of-time plan: every program a stage runs, lowered from shapes on a
mesh (`_plan_shapes`), compiled, and read for memory per chip and XLA's cost.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bd_core import DistillationBatch, as_loss_output
from bd_models import (
    ModelConfig,
    SamplerConfig,
    batch_sharding,
    has_adapters,
    lower,
    lower_denoising_step,
    lower_sample,
    model_flops,
    token_logprobs,
)

from ._accumulate import map_rows
from ._grpo import GRPOBatch, distribution_score, make_grpo_loss
from ._opd import OPDConfig, make_opd_loss, teacher_head
from ._optim import make_optimizer
from ._plan_compile import Twin, figures, splash_flops, twin, twin_cost
from ._plan_resident import held_beside
from ._plan_shapes import bytes_per_chip, check_rows, diffusion_batch, model_maker, place_batch, place_state, sds
from ._replay import replay_capacity
from ._sft import sft_objective
from ._tpu import refusal_bytes
from ._trainer import Trainer, TrainerConfig, TrainState

COSTS = ("all", "train step", "none")  # which programs a plan costs (`stage_programs`)


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One compiled program, per chip: bytes of its arguments (of which `params` are model
    weights and `optimizer` optimizer state), outputs, aliased buffers, temporaries and generated
    code; the compiler's FLOPs and estimated seconds; the model's matmul FLOPs (train steps).

    `params` and `optimizer` are logical bytes (each shard's elements times its dtype's size);
    `argument`, `output`, `alias`, `temp` and `code` are XLA's buffer assignment (`memory_from`
    "xla": TPU layouts pad small dimensions to tiles, so arguments exceed the logical bytes), or,
    for a program the compiler refuses (`memory_from` "logical"), the arguments' and outputs'
    logical bytes and the rest of the total the compiler named (`required`) as temporaries.
    `flops`, `bytes_accessed` and `seconds` are None where no unrolled twin was costed (`--cost`,
    and the samplers): the scanned program's own count holds one pass of each loop, not the work.

    Attributes:
        stage: the stage the program belongs to.
        program: which program (`train step`, `rollout`, ...).
        argument: bytes of its arguments per chip.
        output: bytes of its outputs per chip.
        alias: bytes of outputs that reuse argument buffers.
        temp: bytes of temporaries per chip.
        code: bytes of generated code.
        params: logical bytes of model weights among the arguments.
        optimizer: logical bytes of optimizer state among the arguments.
        flops: the compiler's FLOPs per chip from the unrolled twins, or None where none was costed.
        bytes_accessed: the compiler's bytes accessed per chip from the unrolled twins, or None.
        seconds: the estimated seconds, or None.
        seconds_from: `xla` (the compiler's estimate) or `roofline` (max of FLOPs / peak, bytes / bandwidth).
        model_flops: the model's matmul FLOPs (train steps), for MFU.
        refused: the TPU compiler's out-of-memory message, when the program cannot run there.
        kernel_flops: FLOPs of splash kernels, which XLA's cost analysis cannot see into.
        rollout: for one denoising step of the rollouts: {"rows", "tokens_per_step" (committed per
            step at least: rows x block / steps cap), "steps" (of one rollout batch at most)}.
        memory_from: `xla` (the compiler's buffer assignment) or `logical` (a refused program: shapes' bytes).
        required: a refused program's total bytes per chip as the compiler named them, else None.
        extrapolated: True where `flops`, `bytes_accessed` and `seconds` come from twins of 2 and 3
            layers extrapolated to the model's layers (`approx_cost`), not a twin with every layer
            unrolled: the FLOPs within 1%, the rest approximations.
        resident: bytes per chip the stage holds beside the program, not among its arguments (the
            OPD teacher's weights beside the student's programs, ...: `_plan_resident`).
    """

    stage: str
    program: str
    argument: int
    output: int
    alias: int
    temp: int
    code: int
    params: int
    optimizer: int
    flops: float | None
    bytes_accessed: float | None
    seconds: float | None
    seconds_from: str = ""  # "xla": the compiler's estimate; "roofline": max(FLOPs / peak, bytes / bandwidth)
    model_flops: float | None = None
    refused: str | None = None  # the TPU compiler's own out-of-memory message: the program cannot run there
    kernel_flops: float = 0.0  # splash's kernels, which XLA's cost analysis cannot see into (in `flops`)
    memory_from: str = "xla"  # "logical": a refused program's arguments and outputs from their shapes
    required: int | None = None  # a refused program's total, as the compiler's message names it
    rollout: dict[str, int | float] | None = None  # one denoising step: rows, tokens_per_step, steps
    extrapolated: bool = False  # flops, bytes_accessed, seconds from the 2- and 3-layer twins
    resident: int = 0  # what the stage holds beside the program (`_plan_resident`)

    @property
    def peak(self) -> int:
        """Bytes live at once on a chip: inputs, outputs (less what they alias), temporaries, code
        (for a refused program, the total the compiler named), and what the stage holds beside."""
        if self.required is not None:
            return self.required + self.resident
        return self.argument + self.output - self.alias + self.temp + self.code + self.resident

    def estimates(self, peak_flops: float, *, less: str = "<= ", more: str = ">= ") -> tuple[str, str]:
        """The estimated seconds and MFU as shown: `more` before a time that is the roofline's lower
        bound, `less` before the MFU that is then an upper bound, `~` before both where the time is
        extrapolated (an approximation); "" where there is no time (no twin costed) or, for the MFU,
        no model FLOPs (not a train step)."""
        if not self.seconds:
            return "", ""
        roofline, approx = self.seconds_from == "roofline", "~" if self.extrapolated else ""
        seconds = f"{more if roofline else ''}{approx}{self.seconds:.3g}"
        if not self.model_flops:
            return seconds, ""
        mfu = 100 * self.model_flops / (self.seconds * peak_flops)
        return seconds, f"{less if roofline else ''}{approx}{mfu:.0f}%"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProgramPlan:
        """The plan of a program from its JSON (`dataclasses.asdict`, with or without `peak`)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass
class _Program:
    """A lowered program and `arguments`, the placed shapes it was lowered with; `cost` is its twin
    with the layers unrolled, lowered only for XLA's cost analysis, which counts a loop body once."""

    stage: str
    program: str
    lowered: Any
    arguments: Any
    params: int = 0
    optimizer: int = 0
    model_flops: float | None = None
    cost: Twin | None = None
    kernel_flops: float = 0.0
    rollout: dict[str, int | float] | None = None
    resident: int = 0


def _train_programs(stage: str, trainer: Trainer, maker: Callable[[int | None], Callable[[], Any]], batch: Any,
                    mesh: jax.sharding.Mesh, model_config: ModelConfig, tokens: tuple[int, int], microbatches: int = 1,
                    cost: str = "all", approx_cost: bool = False, streamed: bool = False) -> list[_Program]:
    """The scanned train step, and with `streamed` and `microbatches` > 1 the streamed step's two
    programs (a loop of one's own with `TrainerConfig(streaming=True)` runs them; no stage does);
    `cost` (`COSTS`) says which of them get the unrolled twins that only serve the cost estimate;
    `maker(n)` makes the model with `n` layers (None: its own)."""
    make = maker(None)
    streaming = Trainer(trainer.loss_fn, trainer.optimizer, TrainerConfig(streaming=True, donate=True))
    micro = map_rows(lambda x: sds((x.shape[0] // microbatches, *x.shape[1:]), x.dtype,
                                   x.format if getattr(x, "sharding", None) is not None else None), batch)

    def placed_state(make: Callable[[], Any], streamed: bool = False) -> Any:
        like = jax.eval_shape(lambda: as_loss_output(streaming.loss_fn(
            make(), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), micro), jax.random.key(0)))) \
            if streamed else None
        abstract = eqx.filter_eval_shape(lambda: TrainState.init(make(), trainer.optimizer, key=jax.random.key(0),
                                                                 streaming=streamed, like=like))
        return place_state(abstract, abstract.model, mesh)

    state = placed_state(make)
    # The model's matmul FLOPs: forward, input gradients and weight gradients; with LoRA the frozen
    # weights get no gradient (the adapters' own FLOPs, under 1%, are not counted).
    passes = 2 if has_adapters(state.model) else 3
    flops = passes * model_flops(model_config, tokens)["matmul_forward"] / mesh.size
    params, optimizer = bytes_per_chip(state.model), bytes_per_chip(state.opt_state)
    # For the cost: one microbatch's step with the layers unrolled (the microbatch scan and the
    # layer scan are loops whose bodies XLA's cost analysis counts once), times the microbatches.
    one = Trainer(trainer.loss_fn, trainer.optimizer)
    costed = twin(lambda n: one.lower(placed_state(maker(n)), place_batch(micro, mesh)), model_config.n_layers,
                   exact=not approx_cost, times=microbatches) if cost != "none" else None
    kernel = splash_flops(model_config, tokens, 3, mesh.size)
    placed = place_batch(batch, mesh)
    out = [_Program(stage, "train step", trainer.lower(state, placed), (state, placed), params, optimizer, flops,
                    costed, kernel)]
    if streamed and microbatches > 1:
        state = placed_state(make, streamed=True)
        for update, name in ((False, "streamed step: accumulate"), (True, "streamed step: apply")):
            placed = place_batch(micro, mesh)
            lowered = streaming.lower(state, placed, is_update_step=update)
            costed = twin(lambda n, update=update: streaming.lower(placed_state(maker(n), streamed=True),
                                                                    place_batch(micro, mesh), is_update_step=update),
                           model_config.n_layers, exact=not approx_cost) if cost == "all" else None
            out.append(_Program(stage, name, lowered, (state, placed), params, optimizer, flops / microbatches,
                                costed, kernel / microbatches))
    return out


def _placed_model(make: Callable[[], Any], mesh: jax.sharding.Mesh) -> Any:
    abstract = eqx.filter_eval_shape(make)
    return place_state(abstract, abstract, mesh)


def _sampler_program(stage: str, name: str, make: Callable[[], Any], sampler: SamplerConfig, rows: int,
                     prompt_len: int, mesh: jax.sharding.Mesh) -> _Program:
    model = _placed_model(make, mesh)
    tokens, valid = place_batch((sds((rows, prompt_len), jnp.int32), sds((rows, prompt_len), jnp.bool_)), mesh)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=NamedSharding(mesh, P()))
    return _Program(stage, name, lower_sample(model, tokens, valid, sampler, key=key), (model, tokens, valid, key),
                    bytes_per_chip(model))


def _denoising_step_program(stage: str, make: Callable[[], Any], sampler: SamplerConfig, rows: int,
                            prompt_len: int, mesh: jax.sharding.Mesh) -> _Program:
    """One step of the rollouts' denoising loop, as the sampler runs it: the block's noisy view of
    every row against a KV cache of the whole canvas (its rows over the data axes; replicated over
    `model`, an upper bound on its bytes there), sampling and the commit. The layers are a Python
    loop in the cached forward, so XLA's cost analysis of this program is the step's whole work:
    it is its own cost twin."""
    model = _placed_model(make, mesh)
    cache = eqx.filter_eval_shape(lambda: make().init_cache(rows, prompt_len + sampler.max_new_tokens))
    rows_over = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(mesh))  # noqa: E731
    whole = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    cache = eqx.tree_at(lambda c: (c.k, c.v, c.valid, c.block_ids, c.rope_cos, c.rope_sin), cache,
                        (tuple(map(rows_over, cache.k)), tuple(map(rows_over, cache.v)), rows_over(cache.valid),
                         rows_over(cache.block_ids), whole(cache.rope_cos), whole(cache.rope_sin)))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=NamedSharding(mesh, P()))
    lowered = lower_denoising_step(model, cache, sampler, prompt_len=prompt_len, key=key,
                                   sharding=batch_sharding(mesh))
    rollout = {"rows": rows, "tokens_per_step": rows * sampler.block_size / sampler.steps_cap,
               "steps": sampler.num_blocks * sampler.steps_cap}
    return _Program(stage, "rollouts: one denoising step", lowered, (model, cache, key), bytes_per_chip(model),
                    cost=Twin((lowered,)), rollout=rollout)


def _rows(rows: int, mesh: jax.sharding.Mesh) -> int:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    return -(-rows // shards) * shards


def stage_programs(run: Any, stage: str, mesh: jax.sharding.Mesh, *, cost: str = "all",
                   approx_cost: bool = False, streamed: bool = False) -> list[_Program]:
    """Every program `stage` ("sft-teacher", "sft-student", "opd" or "grpo") of `run` (a
    `shapes_run`) compiles, and the unrolled twins its cost estimates come from: for every program
    but the samplers' with `cost="all"`, the scanned train step's alone with `"train step"`, none
    with `"none"`; twins of every layer unrolled, or with `approx_cost` of 2 and 3 layers
    extrapolated (`Twin`); with `streamed`, also the streamed step's two programs, which no stage
    runs (a loop of one's own with `TrainerConfig(streaming=True)` does)."""
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r}: one of {', '.join(COSTS)}")
    from .stages._rollout import grpo_config

    cfg, canvas = run.config, run.config.canvas
    context = canvas.prompt_len + canvas.max_new_tokens
    eval_sampler = run.sampler_config(cfg.eval.sampler)
    eval_rows = _rows(min(cfg.eval.batch_size, cfg.eval.n), mesh)
    if stage.startswith("sft-"):
        role = stage.removeprefix("sft-")
        sft, model_config = cfg.sft, run.model_config(role)
        check_rows(model_config, mesh, "[sft] batch_size", sft.batch_size, sft.microbatches)
        length = context + canvas.max_new_tokens * sft.corruption.views
        optimizer = make_optimizer(run.optimizer_config(sft.optim, sft.steps_for(role)))
        trainer = Trainer(sft_objective, optimizer, TrainerConfig(microbatches=sft.microbatches, donate=True))
        maker = functools.partial(model_maker, run, role, "sft")
        programs = _train_programs(stage, trainer, maker, diffusion_batch(sft.batch_size, length), mesh, model_config,
                                   (sft.batch_size, length), sft.microbatches, cost, approx_cost, streamed)
        programs.append(_sampler_program(stage, "held-out decoding", maker(None), eval_sampler, eval_rows,
                                         canvas.prompt_len, mesh))
        return _holding(programs, lora=has_adapters(eqx.filter_eval_shape(maker(None))))
    student = run.model_config("student")
    section = cfg.opd if stage == "opd" else cfg.grpo
    sampler = run.sampler_config(section.sampler)
    rows = section.prompts_per_step * (cfg.grpo.group_size if stage == "grpo" else 1)
    key = "[opd] prompts_per_step" if stage == "opd" else "[grpo] prompts_per_step x group_size"
    check_rows(student, mesh, key, rows, section.microbatches)
    length = context + replay_capacity(sampler) * canvas.block_size
    replay = diffusion_batch(rows, length)
    maker = functools.partial(model_maker, run, "student", stage)
    make = maker(None)
    optimizer = make_optimizer(run.optimizer_config(section.optim, section.steps))
    programs = [_sampler_program(stage, "rollouts", make, sampler, rows, canvas.prompt_len, mesh),
                _denoising_step_program(stage, make, sampler, rows, canvas.prompt_len, mesh)]
    if stage == "opd":
        teacher_maker = functools.partial(model_maker, run, "teacher", "opd")
        teacher_config = run.model_config("teacher")
        placed, layout = _placed_model(teacher_maker(None), mesh), place_batch(replay.layout, mesh)
        # As the stage runs it: the teacher's forward writes its final hidden states, rows placed like
        # the batch's, and the train step computes the teacher's logits from them with its head.
        forward = lambda t, layout: t.features(layout)  # noqa: E731
        held = batch_sharding(mesh)
        costed = twin(lambda n: lower(forward, _placed_model(teacher_maker(n), mesh),
                                       place_batch(replay.layout, mesh), out_shardings=held),
                       teacher_config.n_layers, exact=not approx_cost) if cost == "all" else None
        programs.append(_Program(stage, "teacher forward", lower(forward, placed, layout, out_shardings=held),
                                 (placed, layout),
                                 bytes_per_chip(placed),
                                 cost=costed,
                                 kernel_flops=splash_flops(teacher_config, (rows, length), 1, mesh.size)))
        loss = make_opd_loss(OPDConfig(temperature=section.kl_temperature, hard_ce_weight=section.hard_ce_weight,
                                       positions=section.positions, mask_id=run.tokenizer.mask_id))
        features = sds((rows, length, teacher_config.d_model), teacher_config.compute_dtype, held)
        head = teacher_head(placed)
        batch = DistillationBatch(replay, teacher_features=features, teacher_head=head)
    else:
        distribution = sampler.distribution
        ref = sds((rows, length), jnp.float32) if section.beta > 0 else None
        if ref is not None:
            placed = _placed_model(make, mesh)
            score = lambda m, b: token_logprobs(m, b, distribution.without_filters())[0]  # noqa: E731
            costed = twin(lambda n: lower(score, _placed_model(maker(n), mesh), place_batch(replay, mesh)),
                           student.n_layers, exact=not approx_cost) if cost == "all" else None
            scored = place_batch(replay, mesh)
            programs.append(_Program(stage, "reference scoring", lower(score, placed, scored), (placed, scored),
                                     bytes_per_chip(placed), cost=costed,
                                     kernel_flops=splash_flops(student, (rows, length), 1, mesh.size)))
        loss = make_grpo_loss(grpo_config(run), distribution_score(distribution, kl=section.beta > 0))
        batch = GRPOBatch(replay, sds((rows, length), jnp.float32), sds((rows,), jnp.float32), ref)
    trainer = Trainer(loss, optimizer, TrainerConfig(microbatches=section.microbatches, donate=True))
    programs += _train_programs(stage, trainer, maker, batch, mesh, student, (rows, length), section.microbatches,
                                cost, approx_cost, streamed)
    programs.append(_sampler_program(stage, "held-out decoding", make, eval_sampler, eval_rows, canvas.prompt_len,
                                     mesh))
    lora = has_adapters(eqx.filter_eval_shape(make))
    if stage == "opd":
        return _holding(programs, lora=lora, teacher=placed, head=head)
    return _holding(programs, lora=lora, reference=section.beta > 0)


def _holding(programs: list[_Program], **stage: Any) -> list[_Program]:
    held = held_beside(programs, **stage)
    return [dataclasses.replace(p, resident=held[p.program]) for p in programs]


def _refused(program: _Program, message: str) -> ProgramPlan:
    """A program the TPU compiler would not build for lack of HBM ("Ran out of memory on HBM, the
    total memory required for HLO temporaries (37.80G) exceeds available HBM (15.75G)", a total
    that counts arguments and outputs too): its arguments' logical bytes per chip from the shapes
    they were placed with; each output that mirrors an argument (same shape and dtype: a train
    step's new state) like that argument, and aliasing it where the program donates; any other
    output whole (an upper bound: its placement is the compiler's to choose); the rest of the
    named total as temporaries."""
    line = next((s.strip() for s in message.splitlines() if "RESOURCE_EXHAUSTED" in s), message.strip())
    line = line[line.index("RESOURCE_EXHAUSTED"):]
    required = refusal_bytes(line)[0] or 0
    arguments = [x for x in jax.tree.leaves(program.arguments) if isinstance(x, jax.ShapeDtypeStruct)]
    argument = bytes_per_chip(arguments)
    per_chip: dict[tuple, list[int]] = {}
    for x in arguments:
        per_chip.setdefault((tuple(x.shape), x.dtype), []).append(bytes_per_chip(x))
    donates = any(getattr(a, "donated", False) for a in jax.tree.leaves(program.lowered.args_info))
    output = alias = 0
    for out in jax.tree.leaves(program.lowered.out_info):
        mirrored = per_chip.get((tuple(out.shape), out.dtype))
        if mirrored:
            size = mirrored.pop()
            alias += size if donates else 0
        else:
            size = int(np.prod(out.shape, dtype=np.int64)) * out.dtype.itemsize
        output += size
    temp = max(0, required - (argument + output - alias))
    return ProgramPlan(program.stage, program.program, argument, output, alias, temp, 0, program.params,
                       program.optimizer, None, None, None, "", program.model_flops, refused=line,
                       memory_from="logical", required=required, resident=program.resident)


def compile_program(program: _Program, chip: Any, memo: dict[str, Any] | None = None) -> ProgramPlan:
    """Compile for memory (the program as it runs) and for cost (`program.cost`: XLA counts a
    loop body once, so a program without an unrolled twin, a sampler's included, gets no FLOPs,
    bytes accessed or time: its own count would be one pass of its loops). The
    time is XLA's estimate where its TPU cost model gives one, else the roofline bound from its
    FLOPs and bytes accessed against the chip's peak and HBM bandwidth. Splash's kernels are opaque
    to XLA's cost analysis: their FLOPs (`kernel_flops`, an upper bound) are added to its count and
    their time at the chip's peak to its estimate. `memo` (one per slice) keeps every program's
    figures by its StableHLO, so a program that recurs is compiled once."""
    read = figures(program.lowered, memo)
    if read.refused is not None:
        return _refused(program, read.refused)
    seconds, source = None, ""
    if program.cost is not None:
        times, cost = program.cost.times, twin_cost(program.cost, memo)
        flops = times * float(cost.get("flops", 0.0)) + program.kernel_flops
        accessed = times * float(cost.get("bytes accessed", 0.0))
        if not cost:  # XLA's cost analysis returned nothing for this program: no estimate
            seconds, source = None, ""
        elif cost.get("optimal_seconds", -1.0) > 0:  # negative: the cost model has no estimate
            seconds, source = times * float(cost["optimal_seconds"]) + program.kernel_flops / chip.peak_flops, "xla"
        else:
            seconds, source = max(flops / chip.peak_flops, accessed / chip.hbm_bandwidth), "roofline"
    else:  # the scanned program's count holds one pass of each loop: not the work, so none
        flops = accessed = None
    return ProgramPlan(program.stage, program.program, *read.memory, program.params, program.optimizer, flops,
                       accessed, seconds, source, program.model_flops, kernel_flops=program.kernel_flops,
                       rollout=program.rollout, extrapolated=program.cost is not None and program.cost.extrapolated,
                       resident=program.resident)
