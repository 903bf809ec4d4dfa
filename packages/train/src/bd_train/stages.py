"""The pipeline's stages as plain functions: validated config in, small results out.

`run_sft` (teacher or student), `run_opd`, `run_grpo` and `evaluate` need no orchestrator; the
Metaflow flow in `flows/bd_pipeline.py` is a thin graph over them. With a `[mesh]` they run
sharded over it, across processes too once `bd_train.distributed.initialize` has joined a group
(every process calls the same stage with the same config).
"""

from ._config_io import ConfigError as ConfigError
from ._evaluate import evaluate as evaluate
from ._pipeline_config import PipelineConfig as PipelineConfig
from ._pipeline_config import parse_pipeline_config as parse_pipeline_config
from ._pipeline_config import pipeline_config as pipeline_config
from ._stage_grpo import run_grpo as run_grpo
from ._stage_opd import run_opd as run_opd
from ._stage_run import FAULT_ENV as FAULT_ENV
from ._stage_setup import PipelineContext as PipelineContext
from ._stage_setup import Setup as Setup
from ._stage_setup import StageError as StageError
from ._stage_setup import StageResult as StageResult
from ._stage_setup import check_distillation_pair as check_distillation_pair
from ._stage_sft import run_sft as run_sft
from ._summary import format_summary as format_summary
from ._summary import print_summary as print_summary
from ._summary import summarize as summarize
from ._tracking import Tracker as Tracker
