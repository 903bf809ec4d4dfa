"""Multi-process training: join a JAX process group (from the environment, or a `ProcessGroup`
an orchestrator builds) before any computation; meshes then span every process's devices. A
process that sees another stop (killed, out of memory) exits with `EXIT_LOST` and says to resume;
so does every process when the stage's update loop stops making progress (`StallPolicy`).
"""

from ._distributed import COORDINATOR_ENV as COORDINATOR_ENV
from ._distributed import EXIT_LOST as EXIT_LOST
from ._distributed import JOIN_TIMEOUT_ENV as JOIN_TIMEOUT_ENV
from ._distributed import LOST_AFTER_ENV as LOST_AFTER_ENV
from ._distributed import NUM_PROCESSES_ENV as NUM_PROCESSES_ENV
from ._distributed import PROCESS_ID_ENV as PROCESS_ID_ENV
from ._distributed import DistributedError as DistributedError
from ._distributed import ProcessGroup as ProcessGroup
from ._distributed import free_port as free_port
from ._distributed import initialize as initialize
from ._distributed import shutdown as shutdown
from ._watchdog import STALL_FACTOR_ENV as STALL_FACTOR_ENV
from ._watchdog import STALL_FLOOR_ENV as STALL_FLOOR_ENV
from ._watchdog import StallPolicy as StallPolicy
from ._watchdog import Watchdog as Watchdog
