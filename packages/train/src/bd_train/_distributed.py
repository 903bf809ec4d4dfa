"""JAX multi-controller start-up: one process per host (or per local CPU worker), joined through a
coordinator named by the environment or by the orchestrator (the flow builds a `ProcessGroup`
from Metaflow's `current.parallel`). After `initialize`, meshes span every process's devices and
the rest of the stack runs unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import jax

COORDINATOR_ENV = "BDLM_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "BDLM_NUM_PROCESSES"
PROCESS_ID_ENV = "BDLM_PROCESS_ID"


class DistributedError(RuntimeError):
    """A multi-process setting that is missing, inconsistent, or given too late."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands: the coordinator, how many processes join it, and which one this is."""

    coordinator_address: str | None
    num_processes: int
    process_id: int

    @classmethod
    def single(cls) -> ProcessGroup:
        return cls(None, 1, 0)

    @classmethod
    def from_env(cls, environ: os._Environ | dict | None = None) -> ProcessGroup:
        """`BDLM_COORDINATOR_ADDRESS` (host:port), `BDLM_NUM_PROCESSES`, `BDLM_PROCESS_ID`; all three or none."""
        environ = os.environ if environ is None else environ
        names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
        given = [name for name in names if environ.get(name)]
        if not given:
            return cls.single()
        if len(given) != len(names):
            raise DistributedError(f"multi-process start needs all of {names}; only {given} are set. Set the "
                                   f"others, or unset these to run as one process")
        return cls(environ[COORDINATOR_ENV], _int(environ, NUM_PROCESSES_ENV), _int(environ, PROCESS_ID_ENV))


def _int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise DistributedError(f"{name}: expected an integer, got {environ[name]!r}") from None


def free_port() -> int:
    """A TCP port that is free on this host now (for a local coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize(group: ProcessGroup | None = None, *, cpu_devices: int | None = None,
               timeout_s: int = 300) -> ProcessGroup:
    """Join the process group (from the environment when `group` is None) before any JAX
    computation. `cpu_devices` sets the number of local CPU devices (virtual ones for local runs);
    CPU collectives go through gloo. A single-process group only applies `cpu_devices`."""
    group = ProcessGroup.from_env() if group is None else group
    if not 0 <= group.process_id < group.num_processes:
        raise DistributedError(f"process_id {group.process_id} is outside 0..{group.num_processes - 1}; "
                               f"give each process a distinct id below num_processes")
    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if group.num_processes > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as err:  # the backend already exists: too late to change the devices
        raise DistributedError(f"initialize must run before any JAX computation in this process ({err})") from None
    if group.num_processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id,
                                   initialization_timeout=timeout_s)
    return group


def shutdown() -> None:
    """Leave the process group (a no-op for a single process)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
