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

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Cluster:
    """Where this process stands, as a cluster's environment says (see :func:`detect_cluster`).

    Attributes:
        name: ``"slurm"`` or ``"kubernetes"``.
        coordinator: ``HOST:PORT`` of process 0's coordination service.
        num_processes: how many processes take part.
        process_id: this process's rank.
        local_device_ids: the accelerators this process drives (SLURM: ``[SLURM_LOCALID]``,
            one GPU per task, as JAX's own detection does; ignored on CPU), or None.
        read: the environment variables it was read from.
    """

    name: str
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: list[int] | None = None
    read: dict[str, str] = field(default_factory=dict)


def _first_host(nodelist: str) -> str:
    """``node[001-004,9],gpu7`` -> ``node001`` (SLURM's compressed host list)."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    prefix, ranges = (head.group(1), head.group(2)) if head else (nodelist, None)
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


def _int(env: Mapping[str, str], name: str, read: dict[str, str]) -> int:
    value = env[name]
    read[name] = value
    if not value.strip().lstrip("-").isdigit():
        raise ConfigError(
            f"dist.auto=true read {name}={value!r}, expected an integer. Fix: check the job's "
            "environment, or pass dist.num_processes/dist.process_id explicitly."
        )
    return int(value)


def detect_cluster(env: Mapping[str, str] | None = None) -> Cluster | None:
    """The process layout ``dist.auto=true`` reads from a SLURM or Kubernetes environment.

    - **SLURM** (``srun``, or ``sbatch`` with one task per process): ``SLURM_JOB_ID``,
      ``SLURM_NTASKS`` (processes), ``SLURM_PROCID`` (rank), ``SLURM_LOCALID`` (rank on the
      node, for ``local_device_ids``), the first host of ``SLURM_STEP_NODELIST`` (else
      ``SLURM_JOB_NODELIST``) as the coordinator, on port ``JAX_COORDINATOR_PORT`` or, as
      JAX picks it, ``61440 + SLURM_JOB_ID % 4096``.
    - **Kubernetes, an Indexed Job**: ``JOB_COMPLETION_INDEX`` (rank, set by Kubernetes),
      ``JAX_NUM_PROCESSES`` (the Job's ``completions``) and ``JAX_COORDINATOR_ADDRESS``
      (pod 0's stable name through a headless Service, e.g.
      ``train-0.train.default.svc.cluster.local:1234``), both set in the pod template.

    ``JAX_COORDINATOR_ADDRESS`` overrides the coordinator in either case. Returns None in
    neither environment (``dist.auto`` then leaves it to JAX: Open MPI, Cloud TPU).

    Raises:
        ConfigError: an Indexed Job without the coordinator or process count, or a value
            that is not a number.

    Example:
        >>> env = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
        ...        "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]"}
        >>> c = detect_cluster(env)
        >>> c.name, c.coordinator, c.num_processes, c.process_id, c.local_device_ids
        ('slurm', 'gpu07:61586', 2, 1, [1])
        >>> k8s = {"JOB_COMPLETION_INDEX": "0", "JAX_NUM_PROCESSES": "4",
        ...        "JAX_COORDINATOR_ADDRESS": "train-0.train:1234"}
        >>> detect_cluster(k8s).coordinator, detect_cluster({}) is None
        ('train-0.train:1234', True)
    """
    env = os.environ if env is None else env
    read: dict[str, str] = {}
    address = env.get("JAX_COORDINATOR_ADDRESS")
    if address:
        read["JAX_COORDINATOR_ADDRESS"] = address
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
        count = _int(env, "SLURM_NTASKS", read)
        rank = _int(env, "SLURM_PROCID", read)
        job = _int(env, "SLURM_JOB_ID", read)
        local = _int(env, "SLURM_LOCALID", read) if "SLURM_LOCALID" in env else None
        if not address:
            nodes_key = (
                "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
            )
            nodes = env.get(nodes_key, "localhost")
            read[nodes_key] = nodes
            port = env.get("JAX_COORDINATOR_PORT") or str(job % 2**12 + 65535 - 2**12 + 1)
            if "JAX_COORDINATOR_PORT" in env:
                read["JAX_COORDINATOR_PORT"] = port
            address = f"{_first_host(nodes)}:{port}"
        return Cluster("slurm", address, count, rank, None if local is None else [local], read)
    if "JOB_COMPLETION_INDEX" in env:
        rank = _int(env, "JOB_COMPLETION_INDEX", read)
        if not address or "JAX_NUM_PROCESSES" not in env:
            raise ConfigError(
                "dist.auto=true found a Kubernetes Indexed Job (JOB_COMPLETION_INDEX="
                f"{rank}) but not JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, which "
                "Kubernetes does not set. Fix: set both in the pod template: the address of "
                "pod 0 through a headless Service (e.g. train-0.train:1234) and the Job's "
                "completions; or pass dist.coordinator and dist.num_processes."
            )
        count = _int(env, "JAX_NUM_PROCESSES", read)
        return Cluster("kubernetes", address, count, rank, None, read)
    return None


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

    With ``auto=True``, a SLURM job or a Kubernetes Indexed Job is read from the environment
    by :func:`detect_cluster` (what it reads is listed there); elsewhere
    ``jax.distributed.initialize()`` detects Open MPI or Cloud TPU. Any explicit argument
    overrides what is detected. Otherwise ``coordinator`` (process 0's ``HOST:PORT``),
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
    found = detect_cluster() if auto else None
    if found is not None:  # explicit dist.* values win over what the environment says
        coordinator = coordinator or found.coordinator
        num_processes = found.num_processes if num_processes is None else num_processes
        process_id = found.process_id if process_id is None else process_id
        local_device_ids = found.local_device_ids if local_device_ids is None else local_device_ids
        auto = False  # resolved here: JAX's detection (and its Kubernetes API calls) stays off
        if not 0 <= process_id < num_processes:
            raise ConfigError(
                f"dist.auto=true read process {process_id} of {num_processes} from "
                f"{found.read}: the rank is outside [0, {num_processes}). Fix: check the "
                "job's environment (one task per process)."
            )
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
            cluster_detection_method=None if auto else "deactivate",
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


__all__ = ["Cluster", "barrier", "detect_cluster", "initialize", "is_main", "local_batch_size"]
