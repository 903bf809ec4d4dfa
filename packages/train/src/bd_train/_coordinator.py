"""JAX's coordination service in a process of its own, started by process 0 of a group.

Hosted inside process 0 (as `jax.distributed.initialize` does), the service dies with it, and
every other process's JAX client then aborts its process at once with JAX's own fatal message (a
Python callback cannot intercept it in jaxlib 0.10.2: it aborts on converting the status). Out
of process 0, the service outlives it; the others see process 0 stop beating like any other
process and stop with bdlm's message (`_distributed`). Run as `python -m bd_train._coordinator`.
"""

from __future__ import annotations

import errno
import select
import signal
import socket
import subprocess
import sys
import time

READY = "ready"
STOP = "stop"


class ServiceHost:
    """The service's process, seen from process 0, its parent: `stop()` ends it after the group's
    shutdown. If the parent dies first, the service lingers `linger_s` seconds (long enough for
    the others to notice and stop with bdlm's message) and ends on its own."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, bind_address: str, num_processes: int, *, heartbeat_s: int, shutdown_s: int, linger_s: float,
              timeout_s: float = 120.0) -> ServiceHost:
        from ._distributed import DistributedError

        # stdin is the parent's line to the service: "stop", or end-of-file when the parent dies
        # (the pipe is not inherited by the parent's other children: Python's pipes are close-on-exec).
        proc = subprocess.Popen([sys.executable, "-m", "bd_train._coordinator", bind_address, str(num_processes),
                                 str(heartbeat_s), str(shutdown_s), str(linger_s)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().strip() if ready else ""
        if line != READY:
            proc.kill()
            raise DistributedError(f"the group's coordination service did not start on {bind_address} (exit code "
                                   f"{proc.wait()}; its error is printed above); if the port is taken, give the "
                                   "group another coordinator address")
        return cls(proc)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the service (after `jax.distributed.shutdown`: every process has passed its barrier)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(STOP + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):  # it already ended
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def port_taken(bind_address: str) -> str | None:
    """Why the port of `bind_address` (`host:port`, `[::]:port`) is taken, or None when it is free.
    gRPC binds with SO_REUSEPORT, so a second service on a port that a lingering one still holds
    would start too, and split the group's processes between them; a plain bind (which refuses a
    port another socket listens on, whatever its options) tells the two apart first."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT owns nothing
            probe.bind((host, int(port)))
    except OSError as err:  # only "in use" is an answer; anything else (no IPv6 here, say) is gRPC's to judge
        if err.errno == errno.EADDRINUSE:
            return err.strerror or str(err)
    except ValueError:  # not host:port: gRPC names it
        pass
    return None


def main(argv: list[str]) -> int:
    bind_address, num_processes, heartbeat_s, shutdown_s, linger_s = argv
    # A signal to the job (Ctrl-C in a terminal, a preemption's SIGTERM to every process of the pod)
    # must not end the service while the trainers still save their last checkpoint through it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from jaxlib import _jax  # pyright: ignore[reportAttributeAccessIssue]  (the service alone: no backend)

    taken = port_taken(bind_address)
    if taken is not None:
        print(f"bdlm: the coordination service cannot start on {bind_address}: {taken}; another process 0 is "
              f"listening there (a second process given id 0, or a previous group's service, which lingers up to a "
              f"few minutes after its process 0 dies): give each process its own BDLM_PROCESS_ID, wait for the "
              f"old service to end, or give this group another port (the port of BDLM_COORDINATOR_ADDRESS; the "
              f"Metaflow flow's BDLM_COORDINATOR_PORT)", file=sys.stderr)
        return 1
    try:
        service = _jax.get_distributed_runtime_service(bind_address, int(num_processes),
                                                       heartbeat_timeout=int(heartbeat_s),
                                                       shutdown_timeout=int(shutdown_s))
    except Exception as err:  # noqa: BLE001  (reported to the parent through the exit code and stderr)
        print(f"bdlm: the coordination service cannot start on {bind_address}: {err}", file=sys.stderr)
        return 1
    print(READY, flush=True)
    if sys.stdin.readline().strip() != STOP:
        time.sleep(float(linger_s))  # the parent died: let the others see it and stop on their own
    service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
