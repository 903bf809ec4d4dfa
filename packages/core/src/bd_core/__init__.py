"""bd_core: the contracts every bdlm package agrees on.

Weighted metrics that reduce globally (normalize once over all microbatches and devices), typed and
validated batches, traces and rollouts, and config fingerprints. Depends on jax and numpy only.
"""

from ._batch import CLEAN_VIEW as CLEAN_VIEW
from ._batch import DiffusionTokenBatch as DiffusionTokenBatch
from ._batch import DistillationBatch as DistillationBatch
from ._batch import ViewLayout as ViewLayout
from ._batch import attention_allowed as attention_allowed
from ._fingerprint import Fingerprint as Fingerprint
from ._fingerprint import FingerprintMismatch as FingerprintMismatch
from ._fingerprint import canonical as canonical
from ._fingerprint import fingerprint as fingerprint
from ._fingerprint import require_compatible as require_compatible
from ._reducers import LossOutput as LossOutput
from ._reducers import MetricError as MetricError
from ._reducers import WeightedMetric as WeightedMetric
from ._reducers import as_loss_output as as_loss_output
from ._reducers import reduce_metrics as reduce_metrics
from ._rollout import TRACE_VERSION as TRACE_VERSION
from ._rollout import DiffusionTrace as DiffusionTrace
from ._rollout import RolloutOutput as RolloutOutput
from ._rollout import merge_rollouts as merge_rollouts
from ._validate import ContractError as ContractError

__version__ = "0.1.0"
