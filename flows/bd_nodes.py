"""What the flow knows of Metaflow that bd_train must not: the JAX process group of a `@parallel`
step's nodes, and the test hook that makes a stage fail after a saved step."""

import hashlib
import os

from bd_train.distributed import DistributedError, ProcessGroup

PORT_ENV = "BDLM_COORDINATOR_PORT"
# Tests set "<stage>:<step>" (e.g. "grpo:2"): that stage fails right after saving that step, as a
# crash would, so that `resume` can be exercised on a real run.
FAULT_ENV = "BDLM_FAIL_AFTER"
# Metaflow's @parallel gives every node the control node's address but no port: the nodes derive
# the same one from the control task's id, in a range that avoids the usual service ports.
_PORT_BASE, _PORT_SPAN = 20000, 20000


def process_group(parallel, *, run_id: str = "", port: int | None = None) -> ProcessGroup:
    """From `current.parallel` inside a `@parallel` step: the control node (index 0) coordinates at
    `main_ip`; the port is `port`, else `BDLM_COORDINATOR_PORT`, else one that every node derives
    from the run and the control task's id."""
    if parallel.num_nodes == 1:
        return ProcessGroup.single()
    if port is None:
        if os.environ.get(PORT_ENV):
            try:
                port = int(os.environ[PORT_ENV])
            except ValueError:
                raise DistributedError(f"{PORT_ENV}: expected an integer, got {os.environ[PORT_ENV]!r}") from None
        else:
            digest = hashlib.sha256(f"{run_id}/{parallel.control_task_id}".encode()).digest()
            port = _PORT_BASE + int.from_bytes(digest[:4], "big") % _PORT_SPAN
    return ProcessGroup(f"{parallel.main_ip}:{port}", parallel.num_nodes, parallel.node_index)


def fail_after(stage: str) -> int | None:
    """The step after which `stage` is made to fail (`BDLM_FAIL_AFTER=<stage>:<step>`), or None."""
    name, _, step = os.environ.get(FAULT_ENV, "").partition(":")
    return int(step) if name == stage and step else None

