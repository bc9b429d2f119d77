"""JAX's multi-controller runtime for ``coreshell train``: one process per host (or per GPU).

Every process runs the same program: it calls :func:`initialize` before anything touches a JAX
device, reads its own shard of the data (``torchshell.data`` keys the sampler by
``jax.process_index()``), and the bridge assembles the global batch from each process's rows.
Collectives are XLA's own (NCCL on GPU, gloo on CPU); the coordination service of process 0
checks heartbeats, so when a process dies the others stop after ``heartbeat_timeout_s``
instead of hanging. ``coreshell launch`` (:mod:`torchshell.app.launch`) starts the processes on one
machine and reports which rank died at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from torchshell._errors import ConfigError, DistributedError


def _split_address(address: str, name: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{name} must be HOST:PORT (e.g. 10.0.0.1:1234), got {address!r}. Fix: pass the "
            "host name or IP of process 0 and a free port, the same on every process."
        )
    return host, int(port)


def initialize(
    *,
    auto: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    bind_address: str | None = None,
    heartbeat_timeout_s: int = 30,
    init_timeout_s: int = 300,
) -> bool:
    """Joins this process to JAX's distributed runtime; returns whether it is multi-process.

    With ``auto=True``, ``jax.distributed.initialize()`` detects SLURM, Open MPI, Kubernetes
    (indexed Jobs, with the ``kubernetes`` package) or Cloud TPU; any explicit argument
    overrides what it detects. Otherwise ``coordinator`` (process 0's ``HOST:PORT``),
    ``num_processes`` and ``process_id`` say where this process stands; with neither (the
    defaults) nothing happens and the run is a single process. Call it once, before anything
    touches a JAX device; a later call with the same setting (the next job of a sweep) is a
    no-op.

    Args:
        auto: detect the cluster with ``jax.distributed.initialize()``.
        coordinator: ``HOST:PORT`` of process 0 (its coordination service).
        num_processes: how many processes take part.
        process_id: this process's rank, ``0 <= process_id < num_processes``.
        local_device_ids: accelerator ids this process drives (e.g. ``[0]`` for one GPU
            per process); ``None`` takes every local device.
        bind_address: where process 0's coordination service listens (default: every
            interface on the coordinator's port; ``127.0.0.1:PORT`` for one machine).
        heartbeat_timeout_s: seconds without a heartbeat before a process is declared dead
            and the others stop.
        init_timeout_s: seconds to wait for every process to connect.

    Returns:
        ``True`` when more than one process takes part.

    Raises:
        ConfigError: an inconsistent setting (process id out of range, a malformed address,
            a coordinator missing for several processes).
        DistributedError: the runtime could not start (coordinator unreachable, JAX
            already running on its devices), or it runs with another setting already.

    Example:
        >>> initialize()  # no coordinator, no auto-detection: a single process
        False
    """
    if not auto and coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ConfigError(
                f"dist.num_processes={num_processes}, dist.process_id={process_id} need "
                "dist.coordinator=HOST:PORT (process 0's address), got none. Fix: pass "
                "dist.coordinator, or dist.auto=true on SLURM/Open MPI/Kubernetes, or use "
                "`coreshell launch --nproc N -- train` on one machine."
            )
        return False
    if not auto and (num_processes is None or process_id is None):
        raise ConfigError(
            f"dist.coordinator={coordinator} needs dist.num_processes and dist.process_id, "
            f"got {num_processes} and {process_id}. Fix: pass both (the same "
            "num_processes everywhere, process_id 0..N-1), or dist.auto=true to detect them."
        )
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"dist.num_processes must be >= 1, got {num_processes}.")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(
            f"dist.process_id must be in [0, dist.num_processes={num_processes}), got "
            f"{process_id}. Fix: number the processes 0..{num_processes - 1}."
        )
    if coordinator is not None:
        _split_address(coordinator, "dist.coordinator")
    if bind_address is not None:
        _split_address(bind_address, "dist.bind_address")
    if jax.distributed.is_initialized():  # e.g. the second job of a sweep in this process
        here = (jax.process_count(), jax.process_index())
        if auto or (num_processes, process_id) == here:
            return here[0] > 1
        raise DistributedError(
            f"jax.distributed is already initialized here as process {here[1]} of "
            f"{here[0]}, but process {process_id} of {num_processes} was asked for. Fix: "
            "start a new program to join a different run."
        )
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=None if local_device_ids is None else list(local_device_ids),
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            coordinator_bind_address=bind_address,
        )
    except (RuntimeError, ValueError) as err:
        where = coordinator or "auto-detected"
        raise DistributedError(
            f"Could not join the distributed runtime (coordinator {where}, "
            f"process {process_id} of {num_processes}): {err}. Fix: start every process "
            f"within dist.init_timeout_s={init_timeout_s} s with the same coordinator "
            "address, reachable from each host (firewall, DNS), and call initialize before "
            "any JAX computation."
        ) from err
    return jax.process_count() > 1


def is_main() -> bool:
    """Whether this is process 0, the one that logs, prints and writes shared files.

    Example:
        >>> is_main()
        True
    """
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier ``name`` (nothing with one process).

    Example:
        >>> barrier("noop")
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def local_batch_size(global_batch_size: int) -> int:
    """This process's share of a global batch: ``global_batch_size / jax.process_count()``.

    Raises:
        ConfigError: when the processes cannot share the batch evenly.

    Example:
        >>> local_batch_size(64)
        64
    """
    n = jax.process_count()
    if global_batch_size % n:
        raise ConfigError(
            f"data.batch_size={global_batch_size} (the global batch) does not split evenly "
            f"over {n} processes. Fix: use a multiple of {n}."
        )
    return global_batch_size // n


__all__ = ["barrier", "initialize", "is_main", "local_batch_size"]
