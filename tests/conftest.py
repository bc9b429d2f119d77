"""Test setup: 8 fake CPU devices for JAX, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
