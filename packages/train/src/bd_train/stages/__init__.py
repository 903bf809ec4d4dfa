"""The pipeline wing of bd_train: one short recipe per stage over one typed driver.

`run_sft` (teacher or student), `run_opd`, `run_grpo` and `run_rft` (rejection-sampling
fine-tuning, a verifier-only baseline for GRPO) each read top to bottom: build the loss,
the step function and a `StageSpec`, then make one call to `drive`, which owns the loop,
checkpoints, tracking, progress, evaluation and the `StageResult`. `Run` is the run's context
(validated config, folders, named random streams, what the config builds); `roll_out` is the one
rollout helper (sample → gather → decode → reward → NFE) of OPD, GRPO, RFT and `evaluate`. A role
may start from a Hugging Face checkpoint folder (`pretrained`: its weights, architecture and
tokenizer), and `[run] export` writes every stage's model back in that format. `[role] lora` trains LoRA
adapters instead in the stages it names, each on the frozen model the stage starts from.

The stages need no orchestrator: `bd_train.stages.cli.run_chain` (and `python -m bd_train.stages
run <preset>`, the same command on every host of a group) calls them in order; `flows/bd_pipeline.py` is a thin
Metaflow graph over the same functions. With a
`[mesh]` they run sharded over it, across processes too once `bd_train.distributed.initialize`
has joined a group (every process calls the same stage with the same config).
"""

from bd_core import ConfigError as ConfigError

from ._best_of import BestOfN as BestOfN
from ._best_of import best_of_n as best_of_n
from ._best_of import choose as choose
from ._compat import check_adopted as check_adopted
from ._compat import check_distillation_pair as check_distillation_pair
from ._config import PipelineConfig as PipelineConfig
from ._config import parse_pipeline_config as parse_pipeline_config
from ._config import pipeline_config as pipeline_config
from ._config import under_run_precision as under_run_precision
from ._driver import SimulatedFailure as SimulatedFailure
from ._driver import StageResult as StageResult
from ._driver import StageSpec as StageSpec
from ._driver import drive as drive
from ._evaluate import Evaluation as Evaluation
from ._evaluate import NFEPoint as NFEPoint
from ._evaluate import Sample as Sample
from ._evaluate import best_of as best_of
from ._evaluate import evaluate as evaluate
from ._guard import Guard as Guard
from ._intervals import Interval as Interval
from ._intervals import bootstrap_interval as bootstrap_interval
from ._intervals import gain_intervals as gain_intervals
from ._intervals import paired_interval as paired_interval
from ._intervals import wilson_interval as wilson_interval
from ._memory import MemoryLog as MemoryLog
from ._memory import device_memory as device_memory
from ._memory import peaked_in as peaked_in
from ._rollout import Rollouts as Rollouts
from ._rollout import group_rollouts as group_rollouts
from ._rollout import grpo_config as grpo_config
from ._rollout import roll_out as roll_out
from ._rollout import rollout_batch as rollout_batch
from ._run import Run as Run
from ._run import RunDir as RunDir
from ._run import StageError as StageError
from ._sections import shapes_only as shapes_only
from ._summary import curve_rows as curve_rows
from ._summary import format_summary as format_summary
from ._summary import gain_keys as gain_keys
from ._summary import gain_rows as gain_rows
from ._summary import guard_lines as guard_lines
from ._summary import pass_keys as pass_keys
from ._summary import print_summary as print_summary
from ._summary import summarize as summarize
from ._summary import summary_curve_png as summary_curve_png
from ._summary import trained_text as trained_text
from ._tracking import Tracker as Tracker
from .grpo import run_grpo as run_grpo
from .opd import run_opd as run_opd
from .rft import run_rft as run_rft
from .sft import run_sft as run_sft
