"""A small deterministic training run, used by test_checkpoint in this process and in fresh ones.

python resume_run.py MODE CKPT_DIR STEPS OUT.npz — MODE: `full` (train STEPS), `first` (train STEPS
and save), `resume` (restore the latest checkpoint, train STEPS more). Writes parameters and losses.
"""

from __future__ import annotations

import os
import sys

import equinox as eqx
import grain
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bd_train import Checkpointer, OptimizerConfig, Trainer, TrainerConfig, make_optimizer, sft_objective, train_loop  # noqa: E402
from conftest import ToyLM, make_batch  # noqa: E402


def run(mode: str, directory: str, steps: int) -> tuple[np.ndarray, list[float]]:
    config = OptimizerConfig(learning_rate=1e-2, schedule="cosine", warmup_steps=2, total_steps=20, weight_decay=0.01)
    trainer = Trainer(sft_objective, make_optimizer(config), TrainerConfig(microbatches=2))
    data = iter(grain.MapDataset.source(list(range(10_000))).map(lambda i: make_batch(int(i), rows=8))
                .to_iter_dataset())
    state = trainer.init(ToyLM(key=jax.random.key(0)), key=jax.random.key(1))
    checkpointer = Checkpointer(directory)
    target_steps = steps
    if mode == "resume":
        state = checkpointer.restore(state, data_iterator=data)
        target_steps = int(state.step) + steps
    result = train_loop(trainer, state, data, num_steps=target_steps,
                        checkpointer=checkpointer if mode != "full" else None, data_iterator=data)
    checkpointer.close()
    leaves = jax.tree.leaves(eqx.filter(result.state.model, eqx.is_array))
    params = np.concatenate([np.ravel(np.asarray(x)) for x in leaves])
    return params, [h["loss"] for h in result.history]


if __name__ == "__main__":
    mode, directory, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    params, losses = run(mode, directory, steps)
    np.savez(out, params=params, losses=np.asarray(losses, np.float32))
