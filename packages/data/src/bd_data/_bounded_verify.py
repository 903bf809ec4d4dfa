"""math-verify under a hard deadline, from any thread: a worker process parses and verifies, and is
killed (and a fresh one started) when an answer overruns.

math-verify's own timeouts use SIGALRM: whole seconds, main thread only, and a signal cannot stop a
long C call. A process can always be killed. One worker serves a process; concurrent calls take
turns. A call waits for the worker to start (~0.5-2 s of imports: once, and again after a kill) and then at most
its deadline. POSIX only (`poll` on a pipe).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 60.0  # importing sympy on a loaded machine; a worker that takes longer is broken
_WORKER_SCRIPT = Path(__file__).with_name("_math_worker.py")


class VerifyWorkerError(RuntimeError):
    """The math-verify worker process could not be started."""


class _Worker:
    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = -1  # the pid that started the worker: a forked child must not share its pipes
        self._ready = False
        self._buffer = b""

    def start(self) -> None:
        """Start the worker if none is running (returns at once; it imports in the background)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None:
            return
        if self._owner == os.getpid():
            self._stop()
        # -P: the script's folder (this package) must not shadow any module the worker imports.
        self._proc = subprocess.Popen([sys.executable, "-P", str(_WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._owner, self._ready, self._buffer = os.getpid(), False, b""

    def _stop(self) -> None:
        if self._proc is not None and self._owner == os.getpid():
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _read_line(self, deadline: float) -> bytes | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        poller = select.poll()  # not select(): it fails on descriptors past 1024, common in big jobs
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:  # the worker died (e.g. killed for memory): same as running out of time
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def verify(self, gold: str, answer: str, timeout_s: float) -> bool | None:
        with self._lock:
            self._ensure_started()
            if not self._ready:
                if self._read_line(time.monotonic() + STARTUP_TIMEOUT_S) != b"ready":
                    self._stop()
                    raise VerifyWorkerError(
                        f"the math-verify worker ({sys.executable} {_WORKER_SCRIPT}) did not start within "
                        f"{STARTUP_TIMEOUT_S:.0f} s; check that `import math_verify` works in this environment")
                self._ready = True
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps([gold, answer]).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._read_line(time.monotonic() + timeout_s)
            except OSError:  # a broken pipe: the worker is gone
                line = None
            if line is None:
                self._stop()
                self._ensure_started()  # the next call finds a worker already importing
                return None
            return line == b"1"

    def close(self) -> None:
        with self._lock:
            self._stop()


_WORKER = _Worker()
atexit.register(_WORKER.close)


def start_verify_worker() -> None:
    """Start the worker now so its imports overlap with other work (optional; `verify_math` starts it too)."""
    _WORKER.start()


def verify_math(gold: str, answer: str, *, timeout_s: float = 1.0) -> bool | None:
    """math-verify's `verify(parse(gold), parse(answer))` within `timeout_s` of compute, or None
    when it ran past that (the worker is then replaced). A text without `$` delimiters that the
    extractors find nothing in is parsed again as inline math (`$text$`), so bare answers work."""
    return _WORKER.verify(gold, answer, timeout_s)
