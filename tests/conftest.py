"""Test setup: 8 fake CPU devices for JAX, set before JAX initialises."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# coreshell train's compile cache (conf/config.yaml: step.compile_cache_dir) stays out of
# the real ~/.cache/coreshell during tests, for this process and the CLIs it starts.
os.environ.setdefault("CORESHELL_CACHE_DIR", tempfile.mkdtemp(prefix="coreshell-test-cache-"))
