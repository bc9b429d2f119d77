"""``benchmarks/gpu.sh --dry-run``: the GPU readiness script, on CPU with tiny sizes.

The GPU run itself needs a machine this suite does not have; the dry run takes the same steps
(the CUDA DLPack test, the encoder's MFU rows, the three LightningModules trained three ways
each with their target ratios, the one table; the peers' scripts run in
tests/test_benchmarks.py's tiny run) so the script cannot rot.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)  # its stages' limits add up to 1,080 s (a loaded machine's)
def test_gpu_script_dry_run_prints_one_table(child_cache_env: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # JAX's own device count
    env |= {"PY": sys.executable, **child_cache_env}  # the suite's compile cache (conftest)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1140,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    out = proc.stdout
    assert out.count("| benchmark | case | metric |") == 1
    assert re.search(r"load average [\d.]+/[\d.]+/[\d.]+", out)
    assert "gpu: CUDA DLPack hand-over" in out and "skipped (" in out  # no CUDA here
    encoder = [line for line in out.splitlines() if line.startswith("| gpu encoder d=32")]
    assert len(encoder) == 3
    assert all("MFU n/a" in line for line in encoder)  # a CPU has no bf16 peak in the table
    assert any("from_torch" in line for line in encoder)
    lightning = [line for line in out.splitlines() if line.startswith("| gpu lightning")]
    for model in ("Whisper-base encoder", "ViT-B/16", "GPT-2 small"):
        rows = [line for line in lightning if f"| gpu lightning {model} d=32 x2," in line]
        ways = [
            "(l) plain Lightning, eager",
            "(c) plain Lightning, torch.compile(module",
            "(j) JaxModule.from_lightning(module)",
        ]
        for way in ways:
            (row,) = [line for line in rows if way in line]
            assert "| steps/s |" in row and "FAILED" not in row, row
            assert "MFU n/a; peak mem n/a; first step" in row, row  # CPU: no peak, no memory
        for target in (
            "from_lightning / eager (target >= 1.3)",
            "from_lightning / compile (target >= 1.1)",
        ):
            (row,) = [line for line in rows if target in line]
            assert "| ratio |" in row and "CPU dry run" in row and "n/a" not in row, row
    (goal,) = [line for line in lightning if line.startswith("| gpu lightning: goal |")]
    assert "2 of 3 models" in goal and "3 of 3 measured" in goal, goal
    assert "FAILED" not in out
