"""OPD's train step compiled for a v5e-8 (data 2 x fsdp 4) from shapes, with the teacher logits
placed by `logits_sharding` (libtpu's default layout) and by `logits_format` (row-major); prints
the teacher logits' layout and the step's temporaries for each as JSON. Run by `test_plan.py`
with a Python that has libtpu. The shapes are chosen to meet the case `logits_format` is for: 128
rows per chip and a vocabulary shard (4,000 / 4 = 1,000) that is not a multiple of 128 lanes."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format

from bd_core import DistillationBatch
from bd_models import BlockDiffusionLM, ModelConfig, logits_format, logits_sharding
from bd_train import OPDConfig, OptimizerConfig, Trainer, TrainerConfig, TrainState, make_opd_loss, make_optimizer
from bd_train._plan_shapes import diffusion_batch, place_batch, place_state, sds
from bd_train._tpu import topology

ROWS, LENGTH, VOCAB = 256, 64, 4000
config = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, block_size=4,
                     logits_chunk=16)
mesh = jax.sharding.Mesh(np.array(topology("v5e:2x4").devices).reshape(2, 4, 1), ("data", "fsdp", "model"))
optimizer = make_optimizer(OptimizerConfig())
trainer = Trainer(make_opd_loss(OPDConfig()), optimizer, TrainerConfig(microbatches=2, donate=True))
abstract = eqx.filter_eval_shape(lambda: TrainState.init(BlockDiffusionLM(config, key=jax.random.key(0)), optimizer,
                                                         key=jax.random.key(0)))
state = place_state(abstract, abstract.model, mesh)
out = {"shard_bytes": ROWS // 2 * LENGTH * VOCAB // 4 * 4}
for name, placed in (("default", logits_sharding(mesh, VOCAB)), ("row_major", logits_format(mesh, VOCAB))):
    batch = place_batch(DistillationBatch(diffusion_batch(ROWS, LENGTH), sds((ROWS, LENGTH, VOCAB), jnp.float32,
                                                                             placed)), mesh)
    compiled = trainer.lower(state, batch).compile()
    formats = jax.tree.leaves(compiled.input_formats, is_leaf=lambda x: isinstance(x, Format))
    shapes = [tuple(arg.shape) for arg in jax.tree.leaves(compiled.args_info)]
    [logits] = [f for f, shape in zip(formats, shapes, strict=True) if shape == (ROWS, LENGTH, VOCAB)]
    out[name] = {"layout": list(logits.layout.major_to_minor), "temp": compiled.memory_analysis().temp_size_in_bytes}
print(json.dumps(out))
