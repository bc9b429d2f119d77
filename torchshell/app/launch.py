"""``coreshell launch --nproc N [--devices-per-proc K] -- train [OVERRIDES]``: N local processes.

Each child is ``coreshell train`` joined to JAX's distributed runtime (coordinator on
127.0.0.1 and a free port, gloo collectives on CPU) through ``dist.*`` overrides; on CPU,
``--devices-per-proc K`` gives each child K devices (``--xla_force_host_platform_device_count``).
The launcher prefixes every output line with the child's rank, forwards SIGTERM/SIGINT to the
children (they checkpoint together and stop), and when one child fails it stops the others at
once and says which rank died and how: a run cannot go on without every process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from torchshell._errors import ConfigError
from torchshell.app.quiet import GLOO_CONNECTED, verbose

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_POLL_S = 0.05


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now.

    Example:
        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(base: dict[str, str], devices_per_proc: int | None) -> dict[str, str]:
    """The environment of a child: ``base`` with K host devices on CPU and unbuffered output.

    Example:
        >>> child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 4)["XLA_FLAGS"]
        '--xla_force_host_platform_device_count=4'
    """
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_proc is not None:
        flags = _COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={devices_per_proc}")
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def devices_per_child(base: dict[str, str], nproc: int, requested: int | None) -> int | None:
    """CPU devices for each child: ``requested``; else ``None`` when ``base``'s XLA_FLAGS
    already sets a count; else this machine's cores shared out (``cores // nproc``, at least
    1), so that N children do not each take every core (``mesh.cpu_devices=auto``).

    Example:
        >>> devices_per_child({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 2, None)
        >>> devices_per_child({}, 2, 3)
        3
    """
    if requested is not None or _COUNT_FLAG.search(base.get("XLA_FLAGS", "")):
        return requested
    return max(1, len(os.sched_getaffinity(0)) // nproc)


def child_commands(
    train_args: Sequence[str], nproc: int, port: int, *, run_dir: str | None = None
) -> list[list[str]]:
    """The command line of each rank: ``coreshell train`` with the ``dist.*`` overrides.

    Every rank gets the same Hydra run directory (process 0 writes there; the others keep
    Hydra's own files out of it), so a run that starts across a second boundary stays in one
    place. A sweep (``-m``) runs its jobs one after the other, each on all the processes.

    Example:
        >>> cmds = child_commands(["train", "seed=1"], 2, 1234, run_dir="out")
        >>> cmds[1][-5:]
        ['dist.num_processes=2', 'dist.process_id=1', 'dist.bind_address=127.0.0.1:1234', \
'hydra.run.dir=out', 'hydra.output_subdir=null']
    """
    if not train_args or train_args[0] != "train":
        raise ConfigError(
            f"coreshell launch runs `train` in every process, got {list(train_args)[:1]}. "
            "Fix: coreshell launch --nproc 2 -- train [OVERRIDES...]"
        )
    overrides = list(train_args[1:])
    taken = [a for a in overrides if a.split("=", 1)[0].lstrip("+~") in _SET_BY_LAUNCH]
    if taken:
        raise ConfigError(
            f"coreshell launch sets {sorted(_SET_BY_LAUNCH)} itself, got {taken}. Fix: drop "
            "them, or run `coreshell train` with your own dist.* overrides in each process."
        )
    sweep = any(a in ("-m", "--multirun") for a in overrides)
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    user_dir = any(a.startswith(f"{key}=") for a in overrides)
    if run_dir is None and not user_dir:
        run_dir = time.strftime(f"{'multirun' if sweep else 'outputs'}/%Y-%m-%d/%H-%M-%S")
    address = f"127.0.0.1:{port}"
    cmds = []
    for rank in range(nproc):
        cmd = [sys.executable, "-m", "torchshell.app.cli", "train", *overrides]
        cmd += [
            f"dist.coordinator={address}",
            f"dist.num_processes={nproc}",
            f"dist.process_id={rank}",
            f"dist.bind_address={address}",
        ]
        if not user_dir:
            cmd.append(f"{key}={run_dir}")
        if rank > 0:
            cmd.append("hydra.output_subdir=null")
        cmds.append(cmd)
    return cmds


_ABORT = (134, -signal.SIGABRT)
_SET_BY_LAUNCH = {"dist.coordinator", "dist.num_processes", "dist.process_id", "dist.auto"}


def first_failure(codes: Sequence[int | None]) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the child to blame among ``Popen.poll()`` results, if any.

    A process's death makes JAX abort the others (SIGABRT), so a rank that did not abort is
    blamed first; then the lowest rank.

    Example:
        >>> first_failure([-6, -9, None])
        (1, -9)
        >>> first_failure([0, None]) is None
        True
    """
    bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    return min(bad, key=lambda rc: (rc[1] in _ABORT, rc[0])) if bad else None


def _describe(returncode: int) -> str:
    if returncode < 0 and returncode != -signal.SIGABRT:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode in _ABORT:
        return "aborted (SIGABRT: JAX's runtime stopped it, e.g. a peer's heartbeat was lost)"
    return f"exit code {returncode}"


def _pump(rank: int, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    """Relays a child's output, each line prefixed with its rank; gloo's note that a rank
    reached every peer it expected (one per rank, printed by C++) is dropped unless
    ``--verbose`` (a rank that misses a peer is still shown, and fails the run)."""
    prefix = f"[rank {rank}] "
    everything = verbose()
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not everything and GLOO_CONNECTED.match(line):
            continue
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the child and its DataLoader workers


@dataclass
class _Group:
    """The children of one launch and what happened to them."""

    procs: list[subprocess.Popen[bytes]]
    pumps: list[threading.Thread] = field(default_factory=list)
    stopping: bool = False

    def forward(self, signum: int, _frame: object) -> None:
        sig = signal.SIGKILL if self.stopping else signal.SIGTERM
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, sig)

    def kill_rest(self) -> list[int]:
        alive = [rank for rank, p in enumerate(self.procs) if p.poll() is None]
        for rank in alive:
            _signal_group(self.procs[rank], signal.SIGKILL)
        for p in self.procs:
            p.wait()
        return alive


def launch(
    train_args: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    port: int | None = None,
    out: IO[str] | None = None,
) -> int:
    """Runs ``["train", *overrides]`` in ``nproc`` processes; returns the exit code.

    Returns 0 when every process succeeds. When one fails (non-zero exit or a signal), the
    others are killed at once (a run cannot continue without every process, and a survivor
    would otherwise wait for the heartbeat timeout), a message names the rank that died, and
    the return value is non-zero (the dead rank's exit code, or 128 + its signal).

    Args:
        train_args: ``["train", OVERRIDES...]``.
        nproc: processes to start (ranks 0..nproc-1).
        devices_per_proc: CPU devices per process; ``None`` keeps the count XLA_FLAGS
            sets, or else shares the cores out (:func:`devices_per_child`).
        port: the coordinator's port on 127.0.0.1 (default: a free one).
        out: where the prefixed output goes (default: ``sys.stdout``).

    Example:
        >>> launch(["train"], 0)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        torchshell._errors.ConfigError: --nproc must be >= 1, got 0. ...
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}. Fix: --nproc 2 (or more).")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ConfigError(f"--devices-per-proc must be >= 1, got {devices_per_proc}.")
    sink = sys.stdout if out is None else out
    cmds = child_commands(train_args, nproc, free_port() if port is None else port)
    base = dict(os.environ)
    env = child_env(base, devices_per_child(base, nproc, devices_per_proc))
    lock = threading.Lock()
    group = _Group([])
    failed: tuple[int, int] | None = None
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, group.forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank, cmd in enumerate(cmds):
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # terminal signals reach the launcher only
            )
            group.procs.append(proc)
            with lock:
                sink.write(f"coreshell launch: rank {rank} is pid {proc.pid}\n")
                sink.flush()
            pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sink, lock), daemon=True)
            pump.start()
            group.pumps.append(pump)
        while failed is None:
            codes = [p.poll() for p in group.procs]
            failed = first_failure(codes)
            if failed is None and all(c == 0 for c in codes):
                break
            time.sleep(_POLL_S)
        if failed is not None:
            stopped = group.kill_rest()
    finally:
        group.kill_rest()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in group.pumps:
            pump.join(timeout=5)
    if failed is None:
        return 0
    rank, code = failed
    others = f"stopped rank(s) {stopped}" if stopped else "no other rank was still running"
    ended = [
        f"rank {r} {_describe(p.returncode)}"
        for r, p in enumerate(group.procs)
        if r != rank and r not in stopped and p.returncode
    ]
    if ended:
        others += f" ({', '.join(ended)} on its own)"
    print(
        f"coreshell launch: rank {rank} (pid {group.procs[rank].pid}) failed: "
        f"{_describe(code)}; {others}. A run needs every process, so it ended here. "
        f"Fix: look at the [rank {rank}] lines above; continue from the newest checkpoint "
        "with `resume=last`.",
        file=sys.stderr,
    )
    return code if code > 0 else 128 - code


def launch_command(argv: Sequence[str]) -> int:
    """``coreshell launch`` argument parsing; returns the exit code."""
    args = list(argv)
    if "--" in args:
        cut = args.index("--")
        own, train_args = args[:cut], args[cut + 1 :]
    else:
        own, train_args = args, []
    parser = argparse.ArgumentParser(
        prog="coreshell launch",
        description="Start N local processes of `coreshell train` on JAX's distributed runtime.",
        epilog="example: coreshell launch --nproc 2 --devices-per-proc 4 -- train mesh=fsdp",
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--devices-per-proc", type=int, default=None, help="CPU devices per process"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    ns = parser.parse_args(own)
    if not train_args:
        parser.error("missing `-- train [OVERRIDES...]` after the launcher's options")
    try:
        return launch(train_args, ns.nproc, devices_per_proc=ns.devices_per_proc, port=ns.port)
    except ConfigError as err:
        print(f"coreshell launch: {err}", file=sys.stderr)
        return 2


__all__ = [
    "child_commands",
    "child_env",
    "first_failure",
    "free_port",
    "launch",
    "launch_command",
]
