"""bd_train: objectives (SFT, OPD, GRPO family; RFT's batch of accepted samples), exact trace
replay, the trainer, the training loop and Orbax checkpoints — the library half. The pipeline's
stages live in `bd_train.stages` (import it on its own: it brings W&B, plots and the run
config), multi-process start-up in `bd_train.distributed`.

Every objective returns a `bd_core.LossOutput`; the trainer accumulates Σ∇numerator and
Σdenominator over microbatches and devices and normalizes once. A model with LoRA adapters
(`bd_models.add_lora`) trains, accumulates and checkpoints its adapters only.
"""

from ._accumulate import Accumulated as Accumulated
from ._accumulate import accumulate as accumulate
from ._accumulate import interleave_microbatches as interleave_microbatches
from ._accumulate import normalize as normalize
from ._accumulate import split_microbatches as split_microbatches
from ._checkpoint import CheckpointCorrupted as CheckpointCorrupted
from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import CheckpointMismatch as CheckpointMismatch
from ._fingerprints import model_identity as model_identity
from ._fingerprints import rollout_semantics as rollout_semantics
from ._grpo import GRPOBatch as GRPOBatch
from ._grpo import GRPOConfig as GRPOConfig
from ._grpo import compute_advantages as compute_advantages
from ._grpo import distribution_score as distribution_score
from ._grpo import grpo_objective as grpo_objective
from ._grpo import make_grpo_loss as make_grpo_loss
from ._grpo import require_trace as require_trace
from ._loop import LoopResult as LoopResult
from ._loop import run_updates as run_updates
from ._loop import train_loop as train_loop
from ._opd import OPDConfig as OPDConfig
from ._opd import make_opd_loss as make_opd_loss
from ._opd import opd_loss as opd_loss
from ._opd import opd_objective as opd_objective
from ._opd import opd_positions as opd_positions
from ._opd import teacher_head as teacher_head
from ._optim import OptimizerConfig as OptimizerConfig
from ._optim import make_optimizer as make_optimizer
from ._replay import ReplayBatch as ReplayBatch
from ._replay import build_replay as build_replay
from ._replay import replay_capacity as replay_capacity
from ._replay import replay_views as replay_views
from ._rft import rft_batch as rft_batch
from ._rft import sampled_canvas as sampled_canvas
from ._sft import sft_loss as sft_loss
from ._sft import sft_objective as sft_objective
from ._sft import token_cross_entropy as token_cross_entropy
from ._shard_digests import damaged_shards as damaged_shards
from ._shard_digests import shard_digests as shard_digests
from ._trainer import NonFiniteError as NonFiniteError
from ._trainer import Trainer as Trainer
from ._trainer import TrainerConfig as TrainerConfig
from ._trainer import TrainState as TrainState
