"""Several JAX processes: `coreshell launch` trains like one process, and fails loudly.

2 processes x 4 CPU devices (gloo collectives) against 1 process x 8 devices (this test
process, see conftest.py) on the digits MLP, data parallel and fully sharded.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import numpy as np
import pytest
from safetensors.torch import load_file

from tests.helpers import quiet_env
from torchshell._errors import ConfigError
from torchshell.app.config import compose_config, typed
from torchshell.app.launch import (
    child_commands,
    child_env,
    devices_per_child,
    first_failure,
    free_port,
)
from torchshell.app.prepare import build
from torchshell.app.train import train
from torchshell.checkpoint import restore_state, verify
from torchshell.distributed import detect_cluster

STEPS = 20
COMMON = [
    "data=digits",
    "model=digits",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "test_after_fit=false",
    "step.dump_hlo=false",
]


def _losses(uri: str, experiment: str) -> dict[str, list[float]]:
    """``{mesh preset: train/loss per step}`` of every run in ``experiment``."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        history = client.get_metric_history(run.info.run_id, "train/loss")
        out[run.data.params["mesh.preset"]] = [m.value for m in sorted(history, key=_step)]
    return out


def _step(m):
    return m.step


def _launch(tmp_path: Path, nproc: int, devices: int, overrides: list[str]) -> str:
    cmd = [sys.executable, "-m", "torchshell.app.cli", "launch", "--nproc", str(nproc)]
    cmd += ["--devices-per-proc", str(devices), "--", "train", *overrides]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=quiet_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 1] " in proc.stdout and "[rank 0] " in proc.stdout
    return proc.stdout


def _close(ours: dict, theirs: dict, what: str) -> None:
    assert sorted(ours) == sorted(theirs)
    for name in ours:  # Adam turns float noise in near-zero grads into lr-sized steps
        gap = np.linalg.norm(ours[name] - theirs[name]) / np.linalg.norm(theirs[name])
        assert gap < 1e-5, (what, name, gap)


@pytest.fixture(scope="module")
def launched_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`coreshell launch` of a dp,fsdp multirun on 2 processes x 4 devices, STEPS steps each,
    a checkpoint at the end: run once, read by the dp/fsdp test and the cluster test."""
    tmp_path = tmp_path_factory.mktemp("launched")
    launched_uri = f"sqlite:///{tmp_path}/launched.db"
    sweep = tmp_path / "sweep"
    _launch(
        tmp_path,
        2,
        4,
        [
            "-m",
            "mesh=dp,fsdp",
            *COMMON,
            f"ckpt.every_n_steps={STEPS}",
            f"ckpt.dir={tmp_path}/ckpt/${{mesh.preset}}",
            f"tracking.uri={launched_uri}",
            "tracking.experiment=launched",
            f"hydra.sweep.dir={sweep}",
        ],
    )
    return tmp_path


def test_two_processes_match_one_process_with_dp_and_fsdp(launched_sweep: Path, monkeypatch):
    tmp_path = launched_sweep
    monkeypatch.chdir(tmp_path)  # MLflow's artifact store of the in-process runs
    launched_uri = f"sqlite:///{tmp_path}/launched.db"
    sweep = tmp_path / "sweep"
    # only process 0 logs: one MLflow run per job, not one per process
    launched = _losses(launched_uri, "launched")
    assert sorted(launched) == ["dp", "fsdp"]
    # the fsdp run continues on 2 processes from the checkpoint both of them wrote
    more = [f"trainer.max_steps={STEPS + 10}", "resume=last", "mesh=fsdp"]
    _launch(
        tmp_path,
        2,
        4,
        [
            *COMMON,
            *more,
            "ckpt.every_n_steps=0",
            f"ckpt.dir={tmp_path}/ckpt/fsdp",
            f"tracking.uri={launched_uri}",
            "tracking.experiment=resumed",
            f"hydra.run.dir={tmp_path}/resumed",
        ],
    )
    resumed = _losses(launched_uri, "resumed")["fsdp"]
    assert len(resumed) == 10

    base_uri = f"sqlite:///{tmp_path}/base.db"
    for job, preset in enumerate(["dp", "fsdp"]):
        steps = STEPS if preset == "dp" else STEPS + 10
        overrides = [
            *COMMON,
            f"mesh={preset}",
            f"trainer.max_steps={steps}",
            "ckpt.every_n_steps=0",
            f"tracking.uri={base_uri}",
            "tracking.experiment=base",
        ]
        cfg = typed(compose_config(overrides))
        summary = train(cfg, tmp_path / f"base-{preset}")
        base = _losses(base_uri, "base")[preset]
        history = launched[preset] + (resumed if preset == "fsdp" else [])
        assert len(base) == len(history) == steps
        np.testing.assert_allclose(history, base, rtol=1e-5, err_msg=preset)

        # the exported torch weights agree too
        out_dir = sweep / str(job) if preset == "dp" else tmp_path / "resumed"
        _close(
            load_file(out_dir / "export" / "model.safetensors"),
            load_file(summary["export"]),
            preset,
        )

        # the Orbax checkpoint written by both processes is whole: it restores here into
        # the one-process state and holds the weights exported beside it
        final = tmp_path / "ckpt" / preset / f"epoch=1-step={STEPS}.ckpt"
        assert verify(final) is None
        data, module, twin = build(cfg)
        data.setup("fit")
        module.init_state(next(iter(data.train_dataloader())))
        module.state = restore_state(final / "state", module.state)
        written = load_file(final / "export" / "model.safetensors")
        for name, value in module.torch_state_dict(twin).items():
            np.testing.assert_array_equal(value.numpy(), written[name].numpy())
        assert not any(p.name.startswith(".tmp-") for p in final.parent.iterdir())


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def test_killed_process_stops_the_run_with_a_clear_message(tmp_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "torchshell.app.cli",
        "launch",
        "--nproc",
        "2",
        "--devices-per-proc",
        "2",
        "--",
        "train",
        # the digits recipe: what is tested is the launcher's handling of a dead rank, and
        # digits builds its sharded state without the speech set's DataLoader workers
        "data=digits",
        "trainer.max_steps=100000",
        "trainer.log_every_n_steps=1000",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=true",
        "ckpt.every_n_steps=0",
        "step.dump_hlo=false",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"hydra.run.dir={tmp_path}/run",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=quiet_env(),
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    pids: dict[int, int] = {}
    seen = []
    try:
        while True:  # until process 0 has built the sharded state: training has begun
            line = lines.get(timeout=600)
            assert line is not None, "".join(seen)[-3000:] + proc.stderr.read()[-3000:]
            seen.append(line)
            if m := re.match(r"coreshell launch: rank (\d) is pid (\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
            if line.startswith("[rank 0] JAX params on mesh"):
                break
        os.kill(pids[1], signal.SIGKILL)
        # bounded: the launcher notices at once; the timeout only keeps a broken run from
        # hanging the suite
        rc = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert rc != 0
    assert f"rank 1 (pid {pids[1]}) failed: killed by signal SIGKILL" in err, err[-3000:]
    assert "stopped rank(s) [0]" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # the survivor is gone, not left waiting on its peer


def test_launch_commands_and_environment():
    cmds = child_commands(["train", "seed=3"], 2, 4321, run_dir="out")
    assert [c[-6:-2] for c in cmds][1] == [
        "dist.coordinator=127.0.0.1:4321",
        "dist.num_processes=2",
        "dist.process_id=1",
        "dist.bind_address=127.0.0.1:4321",
    ]
    assert cmds[0][-1] == "hydra.run.dir=out" and cmds[1][-1] == "hydra.output_subdir=null"
    env = child_env({"XLA_FLAGS": "--xla_dump_to=/x --xla_force_host_platform_device_count=8"}, 4)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x --xla_force_host_platform_device_count=4"
    # without --devices-per-proc: the environment's count, or the cores shared out
    cores = len(os.sched_getaffinity(0))
    assert devices_per_child(env, 2, None) is None and devices_per_child({}, 2, 3) == 3
    assert devices_per_child({}, 2, None) == max(1, cores // 2)
    assert devices_per_child({}, 4 * cores, None) == 1
    # the rank that died is blamed, not the peer JAX aborted because of it
    assert first_failure([-signal.SIGABRT, -signal.SIGKILL]) == (1, -signal.SIGKILL)
    assert first_failure([None, 1, 2]) == (1, 1) and first_failure([0, None]) is None
    with pytest.raises(ConfigError, match="launch runs `train`"):
        child_commands(["export", "run"], 2, 1)
    with pytest.raises(ConfigError, match=r"sets .* itself"):
        child_commands(["train", "dist.process_id=1"], 2, 1)


def test_dist_config_errors_name_the_fix():
    from torchshell.distributed import initialize

    with pytest.raises(ConfigError, match=r"need dist\.coordinator"):
        initialize(num_processes=2, process_id=1)
    with pytest.raises(ConfigError, match=r"dist.process_id must be in \[0"):
        initialize(coordinator="127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        initialize(coordinator="nohost", num_processes=2, process_id=0)
    assert initialize() is False


def _cluster_run(tmp_path: Path, name: str, envs: list[dict[str, str]], steps: int) -> None:
    """Two `coreshell train dist.auto=true` processes given a cluster's environment."""
    procs = []
    for rank, extra in enumerate(envs):
        cmd = [sys.executable, "-m", "torchshell.app.cli", "train", *COMMON, "dist.auto=true"]
        cmd += [
            f"trainer.max_steps={steps}",
            "ckpt.every_n_steps=0",
            f"tracking.uri=sqlite:///{tmp_path}/clusters.db",
            f"tracking.experiment={name}",
            f"hydra.run.dir={tmp_path}/{name}",
        ]
        if rank:
            cmd.append("hydra.output_subdir=null")
        env = child_env({**quiet_env(), **extra}, 4)
        log = (tmp_path / f"{name}-{rank}.log").open("w")
        procs.append(
            subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
        )
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"{name}-{r}.log").read_text()[-2000:] for r in range(len(envs))]
    assert codes == [0, 0], logs


@pytest.mark.timeout(1500)  # three 2-process runs: minutes on 2 shared cores
def test_slurm_and_kubernetes_environments_train_like_coreshell_launch(
    tmp_path: Path, launched_sweep: Path
):
    """What srun (SLURM) and an Indexed Job (Kubernetes) put in each task's environment,
    given to two local processes with dist.auto=true: the same losses as coreshell launch
    (its dp job of the module's launched sweep: 2 processes x 4 devices, STEPS steps)."""
    steps = STEPS
    port = str(free_port())
    slurm = [
        {
            "SLURM_JOB_ID": "73001",
            "SLURM_JOB_NAME": "coreshell",
            "SLURM_NTASKS": "2",
            "SLURM_NPROCS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_TASKS_PER_NODE": "2",
            "JAX_COORDINATOR_PORT": port,  # (else 61440 + SLURM_JOB_ID % 4096)
        }
        for rank in range(2)
    ]
    _cluster_run(tmp_path, "slurm", slurm, steps)
    k8s_port = str(free_port())
    k8s = [
        {
            "JOB_COMPLETION_INDEX": str(rank),  # set by Kubernetes for an Indexed Job
            "HOSTNAME": f"train-{rank}",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",  # JAX's own k8s detection stays off
            "KUBERNETES_SERVICE_PORT": "443",
            "JAX_NUM_PROCESSES": "2",  # from the pod template (the Job's completions)
            "JAX_COORDINATOR_ADDRESS": f"localhost:{k8s_port}",  # pod 0 via a headless Service
        }
        for rank in range(2)
    ]
    _cluster_run(tmp_path, "kubernetes", k8s, steps)
    uri = f"sqlite:///{tmp_path}/clusters.db"
    launched = _losses(f"sqlite:///{launched_sweep}/launched.db", "launched")
    assert len(launched["dp"]) == steps
    for name in ("slurm", "kubernetes"):
        ran = _losses(uri, name)
        assert list(ran) == ["dp"], name  # one MLflow run: only process 0 logs
        np.testing.assert_allclose(ran["dp"], launched["dp"], rtol=1e-6, err_msg=name)
        client = mlflow.MlflowClient(tracking_uri=uri)
        run = client.search_runs([client.get_experiment_by_name(name).experiment_id])[0]
        assert run.data.tags["processes.count"] == "2"  # it ran on both processes


def test_cluster_environments_are_read_or_refused_with_the_fix():
    assert detect_cluster({}) is None
    c = detect_cluster(
        {
            "SLURM_JOB_ID": "5",
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "3",
            "SLURM_JOB_NODELIST": "n[3-4]",
        }
    )
    assert (c.name, c.coordinator, c.num_processes, c.process_id) == ("slurm", "n3:61445", 4, 3)
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES"):
        detect_cluster({"JOB_COMPLETION_INDEX": "1"})
    with pytest.raises(ConfigError, match="expected an integer"):
        detect_cluster({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "four", "SLURM_PROCID": "0"})
