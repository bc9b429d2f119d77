"""Test setup: 8 fake CPU devices for JAX, set before JAX initialises."""

import os
import tempfile

# XLA's CPU backend unoptimised (benchmarks/_runs.SMOKE_XLA_FLAGS, as the tiny benchmark runs
# and gpu.sh/tpu.sh's dry runs): most of the suite's CPU is cold compiles of tiny steps (65% in
# test_user_batches.py), and these compile about twice as fast; what the tests assert is
# values (to tolerances that an unoptimised backend keeps: no fast-math either way), not
# speed. Children that keep this environment (quiet_env) compile the same way.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {SMOKE_XLA_FLAGS}"
).strip()
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# coreshell train's compile cache (conf/config.yaml: step.compile_cache_dir) stays out of
# the real ~/.cache/coreshell during tests, for this process and the CLIs it starts.
os.environ.setdefault("CORESHELL_CACHE_DIR", tempfile.mkdtemp(prefix="coreshell-test-cache-"))

# The files that take minutes, longest first. `make test`'s two workers take whole files in
# collection order (`--dist loadfile --no-loadscope-reorder`, Makefile): the long files start
# early and the many short ones even out the end, instead of one worker running a long file
# alone after the other ran out of work (xdist's own reorder, by number of tests, put the
# one-test files that take minutes last). Only the order changes; every test still runs.
SLOW_FIRST = (
    "tests/test_benchmarks.py",
    "tests/test_tpu_script.py",
    "tests/torchshell/test_cli.py",
    "tests/torchshell/test_multiprocess.py",
    "tests/zoo/test_zoo.py",
    "tests/torchshell/test_export.py",
    "tests/torchshell/test_resume.py",
    "tests/test_outage_soak.py",
    # the rest by their CPU seconds, each file alone (load 5-10, 2026-12-07): 130, 94, 91, 89,
    # 87, 80; test_tracking (38 s of CPU, ~95 s with its server restarts); 75, 47, 43, 37
    "tests/torchshell/test_torch_patterns.py",
    "tests/torchshell/test_port_audio.py",
    "tests/torchshell/test_trace_ops.py",
    "tests/test_gpu_script.py",
    "tests/torchshell/test_user_batches.py",
    "tests/torchshell/test_serve.py",
    "tests/torchshell/test_tracking.py",
    "tests/test_kill_campaign.py",
    "tests/torchshell/test_quiet_console.py",
    "tests/torchshell/test_multiprocess_eval.py",
    "tests/torchshell/test_cli_errors.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
