"""The train state and the jitted train/eval steps built from any `loss_fn(model, batch, key)`.

What trains is `bd_models.trainable_filter(model)`: every floating array, or only the LoRA
adapters of an adapted model (the frozen base is then neither differentiated nor updated). One
update scans over k microbatches inside one program, or streams them across calls with
`is_update_step=False`; both normalize Σ∇numerator once by the global denominator and reduce the
metrics once per update. Non-finite and empty (zero-denominator) updates are skipped under
`lax.cond` without changing any state dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bd_core import LossOutput, as_loss_output, config_error, reduce_metrics
from bd_models import trainable_filter

from ._accumulate import (
    Accumulated,
    LossFn,
    accumulate,
    interleave_microbatches,
    microbatch_key,
    normalize,
    per_row,
    stack_one,
)


class NonFiniteError(RuntimeError):
    """Too many update steps in a row had a non-finite loss or gradient."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """`microbatches`: k, scanned inside one program per call. `streaming`: keep an accumulator in
    the state so calls with `is_update_step=False` add to the next update. A run stops after
    `max_consecutive_nonfinite` skipped non-finite updates in a row. `donate`: a step hands the
    buffers of the state it replaces (trainable parameters, optimizer state, accumulator) to the
    program, which updates them in place, so a step holds the state once (the pipeline's stages
    do); the state passed in is then spent, its arrays deleted, and so is anything sharing them
    (the model a state was made from): keep the returned state, and copy what must outlive it.
    Off by default, so a library caller's arrays stay valid.

    Attributes:
        microbatches: parts each batch is split into, accumulated exactly in one program.
        streaming: keep an accumulator in the state across calls (`is_update_step=False`).
        max_consecutive_nonfinite: skipped non-finite updates in a row before `NonFiniteError`.
        donate: update the state's buffers in place (the state passed to a step is spent).
    """

    microbatches: int = 1
    streaming: bool = False
    max_consecutive_nonfinite: int = 5
    donate: bool = False

    def __post_init__(self):
        if self.microbatches < 1:
            raise config_error("TrainerConfig", "microbatches", self.microbatches, ">= 1", "use 1 for no accumulation")
        if self.max_consecutive_nonfinite < 1:
            raise config_error("TrainerConfig", "max_consecutive_nonfinite", self.max_consecutive_nonfinite, ">= 1")


class TrainState(eqx.Module):
    """`step` counts update steps taken (applied or skipped); `key` is fixed and folded with the
    step and microbatch index, so a restored run draws the same keys as an uninterrupted one.
    The optimizer is a static field: a state knows how it is updated, and making one (or its
    restore target, `eqx.filter_eval_shape(TrainState.init, ...)`) needs no trainer.

    Attributes:
        step: update steps taken (applied or skipped).
        model: the model (with LoRA adapters, the adapters are what trains).
        opt_state: the optimizer's state.
        key: the base key, folded with the step and microbatch index.
        nonfinite_total: updates skipped for a non-finite loss or gradient.
        nonfinite_streak: such skips in a row.
        accumulator: the streaming accumulator, or None.
        optimizer: the optax transformation (static).
    """

    step: jax.Array
    model: Any
    opt_state: Any
    key: jax.Array
    nonfinite_total: jax.Array
    nonfinite_streak: jax.Array
    accumulator: Accumulated | None
    optimizer: optax.GradientTransformation = eqx.field(static=True)

    @classmethod
    def init(cls, model: Any, optimizer: optax.GradientTransformation, *, key: jax.Array,
             streaming: bool = False, like: LossOutput | None = None) -> TrainState:
        """A fresh state; `streaming=True` carries an `Accumulated` across calls with
        `is_update_step=False`, its metrics shaped by `like` (one microbatch's `LossOutput` or its
        shapes; `Trainer.init` computes it) so that the state keeps one structure at every call."""
        params = eqx.filter(model, trainable_filter(model))
        zero = jnp.zeros((), jnp.int32)
        return cls(step=zero, model=model, opt_state=optimizer.init(params), key=key, nonfinite_total=zero,
                   nonfinite_streak=zero, accumulator=Accumulated.zeros(params, like) if streaming else None,
                   optimizer=optimizer)

    @property
    def params(self) -> Any:
        """What trains: every floating array, or only the LoRA adapters of an adapted model."""
        return eqx.filter(self.model, trainable_filter(self.model))


def _cast_like(tree: Any, dtypes: Any) -> Any:
    # optax may promote (e.g. injected f32 hyperparameters times bf16 moments); cond branches must
    # return the exact dtype tree they were given.
    return jax.tree_util.tree_map(lambda x, dt: x.astype(dt) if jnp.issubdtype(dt, jnp.inexact) else x, tree, dtypes)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _split_state(state: TrainState) -> tuple[TrainState, tuple[Any, Any, Any]]:
    """(kept, donated): what an update replaces (the trainable parameters, the optimizer state,
    the accumulator) apart from the rest (a LoRA model's frozen base, counters, the key), which a
    step passes through and which others may share (GRPO's reference is the base)."""
    trainable = trainable_filter(state.model)
    donated = (eqx.filter(state.model, trainable), state.opt_state, state.accumulator)
    kept = _with(state, model=eqx.filter(state.model, trainable, inverse=True), opt_state=None, accumulator=None)
    return kept, donated


def _join_state(kept: TrainState, donated: tuple[Any, Any, Any]) -> TrainState:
    params, opt_state, accumulator = donated
    return _with(kept, model=eqx.combine(params, kept.model), opt_state=opt_state, accumulator=accumulator)


def _with(state: TrainState, **changes: Any) -> TrainState:
    """`state` with some fields replaced, without `__init__`'s checks: the parts of a state are
    also those of an abstract one (`ShapeDtypeStruct` leaves, when a plan lowers a step) and the
    halves a donating step splits it into."""
    new = object.__new__(TrainState)
    for field in dataclasses.fields(TrainState):
        name = field.name
        object.__setattr__(new, name, changes[name] if name in changes else getattr(state, name))
    return new


def _unshared(donated: Any, kept: Any) -> Any:
    """`donated` with a copy in place of every array that appears twice, or among `kept`: a buffer
    may be donated once, and never while the step also reads it. (A fresh state may share arrays,
    e.g. the zeros a custom optimizer's init returns for two counters.)"""
    seen = {id(x) for x in jax.tree.leaves(kept) if isinstance(x, jax.Array)}

    def once(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if id(x) in seen:
            return jnp.copy(x)
        seen.add(id(x))
        return x

    return jax.tree.map(once, donated)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class Trainer:
    """Train and eval steps for `loss_fn(model, batch, key) -> LossOutput | WeightedMetric | scalar`.

    `step(state, batch)` splits the batch into `config.microbatches` interleaved parts inside the
    program; `step_microbatches(state, stacked)` takes a pre-stacked `[k, rows, ...]` batch (see
    `split_microbatches` for unequal sizes). Both return `(state, metrics)`, metrics reduced with
    `reduce_metrics`: on an update step the loss and aux metrics cover every microbatch of the
    update, on a streaming call with `is_update_step=False` those of the call. Updates
    apply the state's own optimizer; the trainer's is the one `init` puts in new states.

    Example:
        ```python
        import jax
        from bd_data import ByteTokenizer, CanvasConfig, CorruptionConfig, get_task, iterate, sft_dataset
        from bd_models import BlockDiffusionLM, ModelConfig
        from bd_train import OptimizerConfig, Trainer, TrainerConfig, make_optimizer, sft_objective

        task, tok = get_task("argsort", length=6), ByteTokenizer()
        canvas = CanvasConfig(prompt_len=8, max_new_tokens=8, block_size=4)
        batches = iterate(sft_dataset(task.dataset("train"), tok, canvas, CorruptionConfig(), seed=0, batch_size=64))
        model = BlockDiffusionLM(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4,
                                             n_kv_heads=4, d_ff=256, block_size=4), key=jax.random.key(0))
        trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(learning_rate=3e-3)),
                          TrainerConfig(microbatches=2))
        state = trainer.init(model, key=jax.random.key(2))
        for _ in range(3):
            state, metrics = trainer.step(state, next(batches))  # metrics["loss"]: the whole batch's
        ```
    """

    def __init__(self, loss_fn: LossFn, optimizer: optax.GradientTransformation, config: TrainerConfig | None = None):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config or TrainerConfig()
        self._train = eqx.filter_jit(self._train_donating, donate="all-except-first")
        self._train_kept = eqx.filter_jit(self._train_donating)  # the same program, nothing donated
        self._eval = eqx.filter_jit(self._eval_impl)

    def init(self, model: Any, *, key: jax.Array, microbatch: Any = None) -> TrainState:
        """`TrainState.init` with this trainer's optimizer and streaming setting. A streaming
        trainer needs `microbatch` (one microbatch as the loss sees it, arrays or
        `jax.ShapeDtypeStruct`s) to shape its accumulator's metrics: the state then has one
        structure at every call, so an update compiles two programs (accumulate, apply)."""
        if not self.config.streaming:
            return TrainState.init(model, self.optimizer, key=key)
        if microbatch is None:
            raise ValueError("Trainer.init: a streaming trainer (TrainerConfig(streaming=True)) needs microbatch= "
                             "(one microbatch of the batches it will take, or its jax.ShapeDtypeStructs) to shape "
                             "the accumulated metrics")
        like = eqx.filter_eval_shape(lambda m, b, k: as_loss_output(self.loss_fn(m, b, k)), model, microbatch, key)
        return TrainState.init(model, self.optimizer, key=key, streaming=True, like=like)

    # -- train -------------------------------------------------------------------------------------

    def step(self, state: TrainState, batch: Any, *, is_update_step: bool = True) -> tuple[TrainState, dict]:
        """One update (or, with `is_update_step=False`, gradients accumulated without updating) on `batch`, split into
        `config.microbatches` parts; returns the new state and the whole batch's metrics."""
        return self._run(state, batch, is_update_step, presplit=False)

    def step_microbatches(self, state: TrainState, microbatches: Any, *,
                          is_update_step: bool = True) -> tuple[TrainState, dict]:
        """`step` on a batch already split into microbatches (a sequence of them)."""
        return self._run(state, microbatches, is_update_step, presplit=True)

    def lower(self, state: TrainState, batch: Any, *, is_update_step: bool = True) -> jax.stages.Lowered:
        """The program `step(state, batch)` runs, lowered for these shapes (not run): `.compile()`
        gives the compiled step, e.g. for its `memory_analysis()` or `cost_analysis()`. The state
        and batch may hold `jax.ShapeDtypeStruct`s (with shardings) instead of arrays: a plan
        for devices this host does not have (`bd_train.plan`)."""
        kept, donated = _split_state(state)
        dynamic, static = eqx.partition((kept, batch), _is_dynamic)
        donated_dynamic, donated_static = eqx.partition(donated, _is_dynamic)

        def program(dynamic, donated_dynamic):
            (kept, batch), donated = eqx.combine(dynamic, static), eqx.combine(donated_dynamic, donated_static)
            return self._train_donating((kept, batch, is_update_step, False), donated)

        return jax.jit(program, donate_argnums=1 if self.config.donate else ()).lower(dynamic, donated_dynamic)

    def _run(self, state: TrainState, batch: Any, is_update_step: bool, presplit: bool) -> tuple[TrainState, dict]:
        if not is_update_step and state.accumulator is None:
            raise ValueError("is_update_step=False needs an accumulator in the state: build the Trainer with "
                             "TrainerConfig(streaming=True) and call init() again")
        kept, donated = _split_state(state)
        if self.config.donate:
            rest, donated, metrics = self._train((kept, batch, is_update_step, presplit), _unshared(donated, kept))
        else:
            rest, donated, metrics = self._train_kept((kept, batch, is_update_step, presplit), donated)
        state = _join_state(_with(rest, model=kept.model), donated)
        if is_update_step:
            streak = int(state.nonfinite_streak)
            if streak >= self.config.max_consecutive_nonfinite:
                raise NonFiniteError(
                    f"{streak} update steps in a row had a non-finite loss or gradient (at step {int(state.step)}, "
                    f"{int(state.nonfinite_total)} in total); their updates were skipped. Lower the learning rate, "
                    "set OptimizerConfig.max_grad_norm, check the batches for bad values, or raise "
                    "TrainerConfig.max_consecutive_nonfinite"
                )
        return state, metrics

    def _train_donating(self, kept_and_batch: tuple[Any, Any, bool, bool], donated: Any):
        """The step on the state's two halves; returns the new state's counters and key, what it
        donated (or, not donating, would have), updated, and the metrics. The kept model (a LoRA
        model's frozen base) is not an output: a program that returns an argument it does not
        donate writes a copy of it (the whole base, every step), so the caller puts the one it
        passed back in."""
        kept, batch, is_update_step, presplit = kept_and_batch
        state, metrics = self._train_impl(_join_state(kept, donated), batch, is_update_step, presplit)
        rest, donated = _split_state(state)
        return _with(rest, model=None), donated, metrics

    def _stack(self, batch: Any, presplit: bool) -> Any:
        if presplit:
            return batch
        if self.config.microbatches == 1:
            return stack_one(batch)
        return interleave_microbatches(batch, self.config.microbatches)

    def _train_impl(self, state: TrainState, batch: Any, is_update_step: bool, presplit: bool):
        params, static = eqx.partition(state.model, trainable_filter(state.model))  # a LoRA base stays in static
        acc = state.accumulator
        micro = self._stack(batch, presplit)
        call, _ = accumulate(self.loss_fn, params, static, micro, key=state.key, update_step=state.step,
                             start_index=0 if acc is None else acc.count)
        if "loss" in (call.aux or {}):
            raise ValueError("loss_fn: aux metrics may not use the key 'loss' (it names the objective itself)")
        out = call if acc is None else acc + call  # refuses loss settings or aux keys that change mid-update
        if not is_update_step:
            return dataclasses.replace(state, accumulator=out), call.metrics()

        metrics = out.metrics()  # every microbatch of the update, reduced once
        total = out.loss
        grads = normalize(out.grads, total)
        loss = metrics["loss"]
        finite = jnp.isfinite(loss) & _all_finite(grads)
        grad_norm = optax.tree.norm(grads)
        nonempty = total.denominator > 0  # the tokens counted, before a loss's eps / min_denom
        apply_update = finite & nonempty

        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)
        opt_dtypes = jax.tree_util.tree_map(lambda x: x.dtype, state.opt_state)

        def apply(operands):
            p, opt_state, g = operands
            updates, new_opt_state = state.optimizer.update(g, opt_state, p)
            new_p = jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), optax.apply_updates(p, updates), p)
            return new_p, _cast_like(new_opt_state, opt_dtypes)

        def skip(operands):
            p, opt_state, _ = operands
            return p, opt_state

        new_params, new_opt_state = jax.lax.cond(apply_update, apply, skip, (params, state.opt_state, grads))
        nonfinite = (~finite).astype(jnp.int32)
        new_state = dataclasses.replace(
            state,
            step=state.step + 1,
            model=eqx.combine(new_params, static),
            opt_state=new_opt_state,
            nonfinite_total=state.nonfinite_total + nonfinite,
            nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1),
            accumulator=None if acc is None else out.emptied(),
        )
        metrics.update(
            grad_norm=grad_norm,
            update_applied=apply_update.astype(jnp.float32),
            nonfinite=nonfinite.astype(jnp.float32),
            nonfinite_total=new_state.nonfinite_total,
        )
        return new_state, metrics

    # -- eval --------------------------------------------------------------------------------------

    def _eval_impl(self, model: Any, batch: Any, key: jax.Array):
        rows, rebuild = per_row(self._stack(batch, presplit=False))
        count = jax.tree_util.tree_leaves(rows)[0].shape[0]

        def body(_, xs):
            mb, index = xs
            out = as_loss_output(self.loss_fn(model, rebuild(mb), microbatch_key(key, 0, index)))
            return None, {"loss": out.loss.total(), **out.aux}

        _, stacked = jax.lax.scan(body, None, (rows, jnp.arange(count)))
        return stacked

    def evaluate(self, model: Any, batches: Iterable[Any], *, key: jax.Array) -> dict[str, jax.Array]:
        """Metrics over many batches, reduced globally: weighted metrics as Σnum/Σden over all of
        them, plain ones as the mean of per-batch means."""
        buffer = [self._eval(model, batch, jax.random.fold_in(key, i)) for i, batch in enumerate(batches)]
        if not buffer:
            raise ValueError("evaluate: got no batches")
        return reduce_metrics(buffer)

    def eval_step(self, model: Any, batch: Any, *, key: jax.Array) -> dict[str, jax.Array]:
        """The objective's metrics on one batch, without gradients."""
        return self.evaluate(model, [batch], key=key)
