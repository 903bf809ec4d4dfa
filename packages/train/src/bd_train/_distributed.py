"""JAX multi-controller start-up: one process per host (or per local CPU worker), joined through a
coordinator named by the environment or by the orchestrator (the flow builds a `ProcessGroup`
from Metaflow's `current.parallel`). After `initialize`, meshes span every process's devices and
the rest of the stack runs unchanged.

A group is watched: every process beats a heartbeat through the coordinator's key-value store, and
a process that sees another stop beating for `lost_after_s` seconds (killed, out of memory, its
host gone), or loses the coordinator, prints one message that names it and says to `resume`, and
exits with `EXIT_LOST`. A collective that waits on the lost process cannot be interrupted any
other way, and JAX's own end (its coordination service aborting with a C++ fatal error after
its heartbeat timeout) says nothing of what to do; its timeouts are set longer than the watch's
so the watch speaks first. Process 0 starts JAX's coordination service in a child process of its
own (`_coordinator`), not inside itself as `jax.distributed.initialize` would: when process 0
dies, the service lives on, so the others see process 0 stop beating like any other and stop
with bdlm's message (measured: within `lost_after_s` + 1 s), instead of being aborted by their
JAX clients within a second with JAX's message ("the JAX distributed service detected fatal
errors"). Only the loss of the service's own process (process 0's host gone, or the service
killed) still ends the others through JAX's abort. A process that was itself held longer than half
of `lost_after_s` (its host paused or starved) times the others' silence again from when it
wakes, and JAX's timeouts are never below its default 100 s, so a host held for a while
(for less than that) goes on with its group instead of ending it. Nothing half-written is ever restored:
checkpoints are atomic. A step that stops making progress while every heartbeat goes on is the
progress watchdog's (`_watchdog`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

import jax

from ._coordinator import ServiceHost

COORDINATOR_ENV = "BDLM_COORDINATOR_ADDRESS"
"""The environment variable with the coordinator's `host:port` (process 0 listens there)."""
NUM_PROCESSES_ENV = "BDLM_NUM_PROCESSES"
"""The environment variable with the number of processes in the group."""
PROCESS_ID_ENV = "BDLM_PROCESS_ID"
"""The environment variable with this process's index in the group (0 is the coordinator)."""
LOST_AFTER_ENV = "BDLM_LOST_AFTER_S"
"""The environment variable with the seconds after which a silent process counts as lost (default 60)."""
LOST_AFTER_S = 60.0
JAX_HEARTBEAT_S = 100
"""The fewest seconds JAX's coordination service waits for a silent process (its own default) before it aborts the
group; the watch's `lost_after_s` names a lost process first."""
JOIN_TIMEOUT_ENV = "BDLM_JOIN_TIMEOUT_S"
"""The environment variable with the seconds every process waits for the others to start (default 300); past it
JAX ends the process, saying another task died."""
EXIT_LOST = 75  # EX_TEMPFAIL: the run can be resumed
"""The exit code of a process that stops because another was lost or the loop stalled (75, EX_TEMPFAIL): rerun or resume
to continue."""


class DistributedError(RuntimeError):
    """A multi-process setting that is missing, inconsistent, or given too late."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands: the coordinator, how many processes join it, and which one this is.

    Attributes:
        coordinator_address: `host:port` of process 0's coordination service (None: one process).
        num_processes: processes in the group.
        process_id: this process's index (0 is the coordinator).
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int

    @classmethod
    def single(cls) -> ProcessGroup:
        """The group of one process (no coordinator)."""
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
        address = environ[COORDINATOR_ENV]
        count, index = _int(environ, NUM_PROCESSES_ENV), _int(environ, PROCESS_ID_ENV)
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise DistributedError(f"{COORDINATOR_ENV} = {address!r}: expected host:port (process 0's host, and a "
                                   f"free port there, e.g. 10.0.0.1:8476)")
        if count < 1:
            raise DistributedError(f"{NUM_PROCESSES_ENV} = {count}: expected the number of processes, >= 1")
        if not 0 <= index < count:
            raise DistributedError(f"{PROCESS_ID_ENV} = {index}: expected 0..{count - 1} ({NUM_PROCESSES_ENV} = "
                                   f"{count}); give each process a distinct id")
        return cls(address, count, index)


    @classmethod
    def detect(cls) -> tuple[ProcessGroup, str]:
        """This host's group and what named it: the `BDLM_*` variables (`from_env`); else JAX's own
        cluster detection (a Cloud TPU VM, SLURM, Kubernetes, Open MPI: `jax.distributed`'s
        environments), so one identical command on every host is the whole launch; else one
        process."""
        _one_process_per_host()
        if any(os.environ.get(name) for name in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)):
            return cls.from_env(), "the BDLM_* environment"
        from jax._src import clusters  # jax.distributed's detection; no public handle returns what it found

        env = next((e for e in clusters.ClusterEnv._cluster_types if not e.opt_in_only_method and e.is_env_present()),
                   None)
        if env is None:
            return cls.single(), "one process (no BDLM_* variables, no cluster detected)"
        address, count, index, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, 300)
        if count is None or count <= 1:
            return cls.single(), f"one process ({env.name} reports one)"
        return cls(address, int(count), int(index or 0)), f"JAX's {env.name} detection"


def _one_process_per_host() -> None:
    """On accelerators a group is one process per host over all of its devices (JAX's
    one-process-per-device layout is not used); refuse, by name, a launch that asks a process to
    use some of its host's devices, which would otherwise be ignored."""
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        raise DistributedError(f"JAX_LOCAL_DEVICE_IDS = {os.environ['JAX_LOCAL_DEVICE_IDS']!r}: bdlm runs one "
                               f"process per host over all its devices; unset it, and launch one process per host")


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
               timeout_s: int = 300, lost_after_s: float | None = None) -> ProcessGroup:
    """Join the process group (from the environment when `group` is None) before any JAX
    computation. `cpu_devices` sets the number of local CPU devices (virtual ones for local runs);
    CPU collectives go through gloo. A single-process group only applies `cpu_devices`.
    `lost_after_s` (default `BDLM_LOST_AFTER_S`, else 60): how long a silent process is waited for
    before the others stop (see the module docstring). `timeout_s` (or `BDLM_JOIN_TIMEOUT_S`): how
    long every process waits for the others to start.

    Example:
        ```py
        from bd_train import distributed

        group = distributed.initialize()  # BDLM_* variables, or what a TPU VM, SLURM or Kubernetes sets
        ...  # meshes now span every process's devices; every process runs the same stage
        distributed.shutdown()
        ```
    """
    group = ProcessGroup.from_env() if group is None else group
    if os.environ.get(JOIN_TIMEOUT_ENV):
        timeout_s = _int(os.environ, JOIN_TIMEOUT_ENV)
        if timeout_s < 1:
            raise DistributedError(f"{JOIN_TIMEOUT_ENV} = {timeout_s}: expected seconds, >= 1")
    if not 0 <= group.process_id < group.num_processes:
        raise DistributedError(f"process_id {group.process_id} is outside 0..{group.num_processes - 1}; "
                               f"give each process a distinct id below num_processes")
    lost_after = _lost_after(lost_after_s)
    try:
        if cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        if group.num_processes > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as err:  # the backend already exists: too late to change the devices
        raise DistributedError(f"initialize must run before any JAX computation in this process ({err})") from None
    if group.num_processes > 1 and not jax.distributed.is_initialized():
        watch_s = int(2 * lost_after) + 10  # by then the watch has spoken (see the docstring)
        jax_timeout = max(watch_s, JAX_HEARTBEAT_S)  # JAX's own ends come after the watch's
        if group.process_id == 0:
            _start_service(group, jax_timeout, linger_s=watch_s, timeout_s=timeout_s)
        _connect(group, init_timeout=timeout_s, heartbeat_timeout=jax_timeout)
        _start_watch(group, lost_after)
    return group


_SERVICE: ServiceHost | None = None


def _start_service(group: ProcessGroup, jax_timeout: int, *, linger_s: int, timeout_s: int) -> None:
    global _SERVICE
    assert group.coordinator_address is not None
    port = group.coordinator_address.rsplit(":", 1)[1]
    bind_address = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")  # as JAX binds it
    # It lingers until the others have stopped on the watch, and no longer: a restarted group needs the port.
    _SERVICE = ServiceHost.start(bind_address, group.num_processes, heartbeat_s=jax_timeout, shutdown_s=jax_timeout,
                                 linger_s=linger_s, timeout_s=timeout_s)


def _connect(group: ProcessGroup, *, init_timeout: int, heartbeat_timeout: int) -> None:
    """What `jax.distributed.initialize` (jax 0.10.2, `State.initialize`) does on every process, except
    hosting the coordination service: process 0 connects to `ServiceHost`'s like the others."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    if xla_bridge.backends_are_initialized():
        raise DistributedError("initialize must run before any JAX computation in this process (a backend exists)")
    state = distributed.global_state
    state.coordinator_address, state.process_id, state.num_processes = (group.coordinator_address, group.process_id,
                                                                        group.num_processes)
    sys.stderr.write(f"bdlm: process {group.process_id} joins the {group.num_processes}-process group at "
                     f"{group.coordinator_address}, waiting up to {init_timeout} s for every process to start "
                     f"({JOIN_TIMEOUT_ENV})\n")
    client = _jax.get_distributed_runtime_client(group.coordinator_address, group.process_id,
                                                 init_timeout=init_timeout, use_compression=True,
                                                 heartbeat_timeout=heartbeat_timeout)
    state.client = client
    client.connect()
    state.initialize_preemption_sync_manager()
    partition = os.environ.get("JAX_PARTITION_INDEX")
    state.partition_index = None if partition is None else int(partition)


def _lost(group: ProcessGroup, who: str, why: str) -> None:
    """Say what the group lost (`who`: a process, or its coordination service) and how to go on,
    and end this process (from any thread)."""
    sys.stderr.write(
        f"\nbdlm: {who} of the {group.num_processes}-process group is lost ({why}); process {group.process_id} "
        f"stops too, since the group cannot go on without it. What was saved is complete (checkpoints are "
        f"atomic): restart the group with `resume` (the flow's `resume`, or the same stages again) to continue "
        f"from the last checkpoint.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_LOST)


def _lost_after(value: float | None) -> float:
    if value is None:
        raw = os.environ.get(LOST_AFTER_ENV)
        try:
            value = LOST_AFTER_S if raw is None else float(raw)
        except ValueError:
            raise DistributedError(f"{LOST_AFTER_ENV}: expected seconds, got {raw!r}") from None
    if not value >= 2:
        name = LOST_AFTER_ENV if os.environ.get(LOST_AFTER_ENV) else "lost_after_s"
        raise DistributedError(f"{name} = {value:g}: a process must be allowed at least 2 s of silence")
    return float(value)


class _Watch(threading.Thread):
    """The heartbeat and the watch of one process of a group (a daemon thread)."""

    def __init__(self, group: ProcessGroup, lost_after: float):
        super().__init__(name="bdlm-group-watch", daemon=True)
        from jax._src import distributed  # the coordinator's client: its key-value store has no public handle

        client = distributed.global_state.client
        if client is None:
            raise DistributedError("the group watch needs JAX's distributed client; call jax.distributed.initialize "
                                   "first")
        self.client = client
        self.group, self.lost_after = group, lost_after
        self.interval = min(1.0, lost_after / 10)
        self.finished = threading.Event()

    def run(self) -> None:
        me, n = self.group.process_id, self.group.num_processes
        last: dict[int, tuple[str | None, float]] = {p: (None, time.monotonic()) for p in range(n) if p != me}
        unreachable_since: float | None = None
        beat, woke = 0, time.monotonic()
        while not self.finished.wait(self.interval):
            now = time.monotonic()
            if now - woke > self.lost_after / 2:
                # This process was held itself (its host paused or starved): the others' silence was not
                # watched, so it is timed again from now rather than blamed on them.
                last = {p: (seen, now) for p, (seen, _) in last.items()}
                unreachable_since = None
            woke = now
            try:
                beat += 1
                self.client.key_value_set(f"bdlm/alive/{me}", str(beat), allow_overwrite=True)
                for p, (seen, since) in list(last.items()):
                    if _try_get(self.client, f"bdlm/done/{p}") is not None:
                        del last[p]  # it left the group normally
                        continue
                    value = _try_get(self.client, f"bdlm/alive/{p}")
                    if value != seen:
                        last[p] = (value, now)
                    elif now - since > self.lost_after:
                        _lost(self.group, f"process {p}", f"sent no heartbeat for {now - since:.0f} s")
                unreachable_since = None
            except Exception as err:  # noqa: BLE001  (the coordinator's service is gone)
                if self.finished.is_set():
                    return
                unreachable_since = unreachable_since or now
                if now - unreachable_since > min(self.lost_after, 5.0):
                    _lost(self.group, "the coordination service (a process of its own beside process 0)",
                          f"it no longer answers ({type(err).__name__})")

    def leave(self) -> None:
        """Say this process leaves normally (the others stop watching it), then stop."""
        try:
            self.client.key_value_set(f"bdlm/done/{self.group.process_id}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001,S110  (a coordinator already gone: nothing to tell)
            pass
        self.finished.set()


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as err:  # noqa: BLE001  (NOT_FOUND is an exception here)
        if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
            return None
        raise


_WATCH: _Watch | None = None


def _start_watch(group: ProcessGroup, lost_after: float) -> None:
    global _WATCH
    _WATCH = _Watch(group, lost_after)
    _WATCH.start()


def shutdown() -> None:
    """Leave the process group (a no-op for a single process)."""
    global _WATCH, _SERVICE
    if _WATCH is not None:
        _WATCH.leave()
        _WATCH = None
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    if _SERVICE is not None:  # after every client's shutdown barrier: nobody needs the service now
        _SERVICE.stop()
        _SERVICE = None


def check_shared_folder(folder: str | os.PathLike, what: str) -> None:
    """Every process of the group must see the one `folder` (its checkpoints are written by all
    of them together): process 0 leaves a token there and every process reads it back, or every
    process refuses, naming those that do not see it (a per-host disk, another run id). One
    process: nothing to check."""
    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    marker = os.path.join(os.fspath(folder), ".process-group")
    token = np.frombuffer(os.urandom(8), np.int64) if jax.process_index() == 0 else np.zeros(1, np.int64)
    token = multihost_utils.broadcast_one_to_all(token)
    if jax.process_index() == 0:
        with open(marker, "w") as file:
            file.write(str(int(token[0])))
    multihost_utils.sync_global_devices("bdlm-shared-folder-written")
    try:
        with open(marker) as file:
            seen = file.read().strip() == str(int(token[0]))
    except OSError:
        seen = False
    blind = [i for i, ok in enumerate(multihost_utils.process_allgather(np.int32(seen))) if not ok]
    if blind:
        raise DistributedError(f"{what}: process(es) {blind} do not see the folder {os.fspath(folder)!r} that process "
                               f"0 writes: every process of a group must write one folder (shared storage: NFS, a "
                               f"mounted bucket, the node's shared disk), and run with the same --run-id")
