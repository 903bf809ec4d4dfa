"""bd_core: the contracts every bdlm package agrees on.

Weighted metrics that reduce globally (normalize once over all microbatches and devices), typed and
validated batches, traces and rollouts, the attention rule of the view layout, config errors and
fingerprints; where a released checkpoint's files are (`resolve_pretrained`: a folder, or a Hub
repo id through the Hub cache); and `with_huge_page_malloc`, the glibc setting that spares XLA:CPU
a page fault per 4 KiB of its buffers per execution. Depends on jax and numpy, and on
huggingface_hub, imported only when a Hub id is resolved.

Shape letters, one meaning each across every bdlm package (arrays are named `x_BxTxD`):

    B batch rows            T packed tokens (queries)    S keys / cache slots
    L layers                D d_model                    E head dim
    F MLP hidden            H query heads                K kv heads
    G query heads per kv head                            V vocab
    P prompt length         N new (completion) tokens    C canvas length P + N
    b block size            R denoising steps recorded in a trace
    W replay views          Q query tile                 U key tile
    I query tiles           J key tiles
"""

from ._batch import CLEAN_VIEW as CLEAN_VIEW
from ._batch import DiffusionTokenBatch as DiffusionTokenBatch
from ._batch import DistillationBatch as DistillationBatch
from ._batch import TeacherHead as TeacherHead
from ._batch import Unsplit as Unsplit
from ._batch import ViewLayout as ViewLayout
from ._config import ConfigError as ConfigError
from ._config import config_error as config_error
from ._fingerprint import Fingerprint as Fingerprint
from ._fingerprint import FingerprintMismatch as FingerprintMismatch
from ._fingerprint import canonical as canonical
from ._fingerprint import fingerprint as fingerprint
from ._fingerprint import require_compatible as require_compatible
from ._host_memory import huge_page_malloc_active as huge_page_malloc_active
from ._host_memory import thp_mode as thp_mode
from ._host_memory import tunable_takes_effect as tunable_takes_effect
from ._host_memory import with_huge_page_malloc as with_huge_page_malloc
from ._hub import HUB_FILES as HUB_FILES
from ._hub import SHAPE_FILES as SHAPE_FILES
from ._hub import HubError as HubError
from ._hub import PretrainedSource as PretrainedSource
from ._hub import is_repo_id as is_repo_id
from ._hub import resolve_pretrained as resolve_pretrained
from ._mask import TokenMeta as TokenMeta
from ._mask import allowed as allowed
from ._mask import attention_allowed as attention_allowed
from ._reducers import LossOutput as LossOutput
from ._reducers import MaxMetric as MaxMetric
from ._reducers import MetricError as MetricError
from ._reducers import WeightedMetric as WeightedMetric
from ._reducers import as_loss_output as as_loss_output
from ._reducers import reduce_metrics as reduce_metrics
from ._rollout import TRACE_VERSION as TRACE_VERSION
from ._rollout import DiffusionTrace as DiffusionTrace
from ._rollout import RolloutOutput as RolloutOutput
from ._rollout import merge_rollouts as merge_rollouts
from ._validate import ContractError as ContractError
from ._validate import is_concrete as is_concrete

__version__ = "0.1.0"
