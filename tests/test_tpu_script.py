"""``benchmarks/tpu.sh --dry-run``: the TPU script, on CPU with tiny sizes.

The TPU run needs the device machine; the dry run takes every stage (the encoder three ways,
the three LightningModules beside their pure-Flax twins, the speech recipe through
``coreshell train``, the transfer, the digits peers) and prints the one table, so the script
cannot rot. Its figures mean nothing (CPU, unoptimised XLA); the rows must all be there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)  # its stages' dry-run limits: a loaded 2-core machine's
def test_tpu_script_dry_run_prints_every_row(child_cache_env: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # JAX's own device count
    env |= {"PY": sys.executable, **child_cache_env}  # the suite's compile cache (conftest)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "tpu.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1750,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-4000:] + out[-3000:]
    assert out.count("| benchmark | case | metric |") == 1
    assert re.search(r"load average [\d.]+/[\d.]+/[\d.]+", out)
    assert "FAILED" not in out
    table = out.split("| benchmark | case | metric |", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    encoder = [r for r in rows if r.startswith("| gpu encoder d=32")]
    assert len(encoder) == 4 and any("from_torch" in r for r in encoder)
    assert any("(l) JaxModule.from_lightning" in r for r in encoder)
    assert not [r for r in rows if r.startswith("| tpu Whisper-base encoder ")]  # (stage 1's)
    for model in ("ViT-B/16", "GPT-2 small"):
        mine = [r for r in rows if r.startswith(f"| tpu {model} ")]
        assert any("(f) pure-Flax twin" in r and "| steps/s |" in r for r in mine), mine
        assert any("(j) JaxModule.from_lightning" in r and "| steps/s |" in r for r in mine)
        assert any("from_lightning / pure-Flax twin" in r and "| ratio |" in r for r in mine)
    speech = [r for r in rows if r.startswith("| tpu speech recipe")]
    assert len(speech) == 5 and all("n/a" not in r for r in speech), speech
    transfer = [r for r in rows if r.startswith("| tpu transfer")]
    assert len(transfer) == 9
    digits = [r for r in rows if r.startswith("| peers/digits MLP, user DataLoader")]
    assert any("(a) coreshell at its defaults" in r for r in digits)
    assert any("(c) Keras 3" in r for r in digits) and any("(e) hand-written" in r for r in digits)


def test_tpu_script_refuses_an_unknown_stage_before_running_any() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "tpu.sh"), "--dry-run", "models,digit"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "unknown stage 'digit'" in proc.stderr
    assert "models,encoder,transfer,digits,speech" in proc.stderr
    assert "JAX" not in proc.stdout  # nothing started
