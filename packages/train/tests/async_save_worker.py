"""A process for `test_checkpoint.py` to kill during an asynchronous save:
`python async_save_worker.py <dir>` commits step 1 of a state of about 200 MB, starts the
asynchronous save of step 2, writes `<dir>/step2_started` and goes on computing until killed."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

from bd_models import BlockDiffusionLM, ModelConfig
from bd_train import Checkpointer, OptimizerConfig, Trainer, make_optimizer, sft_objective

BIG = ModelConfig(vocab_size=16384, d_model=1024, n_layers=1, n_heads=8, n_kv_heads=8, d_ff=1024, block_size=4,
                  attention="dense")


def state(step: int):
    """A train state of `BIG` whose floating arrays are shifted by `step` (about 200 MB)."""
    trainer = Trainer(sft_objective, make_optimizer(OptimizerConfig(mu_dtype="bfloat16")))
    base = trainer.init(BlockDiffusionLM(BIG, key=jax.random.key(0)), key=jax.random.key(1))
    shift = jax.tree.map(lambda x: x + step if eqx.is_inexact_array(x) else x, (base.model, base.opt_state))
    return dataclasses.replace(base, model=shift[0], opt_state=shift[1], step=jnp.asarray(step, base.step.dtype))


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    checkpoints = Checkpointer(folder, async_save=True)
    checkpoints.save(state(1))
    checkpoints.wait()
    checkpoints.save(state(2))
    (folder / "step2_started").write_text("")
    x = jnp.ones((512, 512))
    while True:  # training goes on while step 2 is written
        x = (x @ x) / 512
