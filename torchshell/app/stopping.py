"""A child server that stops whole: its own process group, stopped on SIGINT/SIGTERM.

``mlflow models serve`` starts uvicorn and its workers; a SIGTERM to ``coreshell serve``
used to end coreshell alone and leave them answering on the port, and the temporary model
folder behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` as SIGINT does (main thread only), so that a
    stopped ``coreshell serve`` unwinds: its server stopped, its temporary folders removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Stops ``proc``'s whole process group (the server, the workers it started): SIGTERM,
    then SIGKILL for whatever is left after ``grace_s``."""

    def alive() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)  # reaps the leader, so that the group can be gone
        if not alive():
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_whole(cmd: list[str], env: dict[str, str]) -> int:
    """Runs ``cmd`` in its own process group until it ends, or until SIGINT/SIGTERM: then the
    whole group is stopped (``mlflow models serve`` starts uvicorn and its workers, which
    outlived a SIGTERM to coreshell and kept answering on the port).

    Example:
        >>> import os, sys
        >>> run_whole([sys.executable, "-c", "pass"], dict(os.environ))
        0
    """
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        with stop_signals():
            return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop_group(proc)


def announce(host: str, port: int, line: str, every: float = 0.5) -> threading.Thread:
    """Prints ``line`` on stderr once ``host:port`` accepts a connection (the server listens
    once its app has started), from a daemon thread that ends with the first connection or
    with coreshell. A bare connection, not a request: the server's access log stays the
    user's requests.

    Example:
        >>> announce("127.0.0.1", 9, "never printed", every=0.01).daemon
        True
    """

    def wait() -> None:
        while not port_answers(host, port):
            time.sleep(every)
        print(line, file=sys.stderr, flush=True)

    thread = threading.Thread(target=wait, name="coreshell-serve-announce", daemon=True)
    thread.start()
    return thread


def port_answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``.

    Example:
        >>> port_answers("127.0.0.1", 9)  # the discard port: nothing listens on it here
        False
    """
    import socket

    with socket.socket() as probe:
        probe.settimeout(2.0)
        return probe.connect_ex((host, port)) == 0
