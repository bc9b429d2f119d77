"""Test setup: 8 fake CPU devices for JAX, set before JAX initialises."""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

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
# The test processes use that cache too (JAX's persistent compilation cache, every compile):
# many tests compile the same tiny programs (the digits MLP's step, the same shapes), each in
# a new jitted function, so JAX's in-memory caches miss and XLA compiled each again; a cache
# hit reads the executable XLA wrote for an identical program (same HLO, flags and devices),
# so every value is the same. test_user_batches.py + test_speed_defaults.py: 81 -> 65 CPU-s
# (the zoo: no change, its programs differ). An in-process
# `coreshell train` (prepare_run) switches to this same directory; a test that turns the
# cache off or elsewhere (jaxcore/test_compile.py, compile_cache_dir=null) gets it back only
# after it ends (_compile_cache below). The children a test starts choose their own cache.
COMPILE_CACHE = Path(os.environ["CORESHELL_CACHE_DIR"]).expanduser().resolve() / "jax"
# The same cache for the benchmark scripts a test starts (tpu.sh's and gpu.sh's dry runs,
# run.py --tiny), by JAX's own variables: several of them compile the same tiny programs (the
# encoder of gpu_encoder.py in both dry runs, the three LightningModules' from_lightning steps,
# the digits MLP's on the user's loader), and a hit reads what XLA wrote for an identical
# program (user_path.py's forms and peers compile the same steps in new jitted functions
# within one process too). CPU-s, 2026-12-08 at load 6-13: test_benchmarks.py's tiny run
# 266 -> 216; gpu.sh's dry run after tpu.sh's 77 -> 59.
CHILD_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(COMPILE_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # (its default, 1 s, skips most)
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}

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


@pytest.fixture(autouse=True)
def _compile_cache() -> Iterator[None]:
    """Each test starts with the suite's persistent compilation cache on (see above)."""
    import jax

    import jaxcore

    if jax.config.jax_compilation_cache_dir != str(COMPILE_CACHE):
        jaxcore.enable_compile_cache(COMPILE_CACHE)
    yield


@pytest.fixture(scope="session")
def child_cache_env() -> dict[str, str]:
    """JAX's variables that put a child process on the suite's compilation cache (above)."""
    return dict(CHILD_CACHE_ENV)
