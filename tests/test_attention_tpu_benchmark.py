"""``benchmarks/attention_tpu.py --dry-run``: attend's implementations timed at tiny shapes on
the CPU (the Pallas kernels interpreted). The figures mean nothing here; the rows and the table
must all be there, and a cell that raises must be a FAILED row, not an abort."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks import attention_tpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # ~15 s of CPU; minutes of wall time on a loaded 2-core machine
def test_the_dry_run_times_every_implementation_at_every_model_shape(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    script = ROOT / "benchmarks" / "attention_tpu.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["benchmark"], r["case"]): r for r in rows}
    models, cases = ("encoder", "gpt2", "vit"), attention_tpu.IMPLEMENTATIONS
    assert set(cells) == {(f"attention/{m}", c) for m in models for c in cases}
    assert all(r["n"] == 1 and r["median"] > 0 and not r.get("failed") for r in rows)
    assert all(cells[f"attention/{m}", "default"]["note"].endswith("took xla") for m in models)
    table = proc.stdout[proc.stdout.index("| model |") :].splitlines()
    assert len(table) == 2 + len(rows) and "| gpt2 | splash |" in proc.stdout


def test_a_cell_that_raises_is_a_failed_row_and_the_table_says_so() -> None:
    def refusing(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        raise ValueError("Mosaic says no\nsecond line")

    shape = attention_tpu.DRY_SHAPES["vit"]
    row = attention_tpu.measure("vit", shape, "splash block 256", refusing, 1)
    assert row["failed"] and row["n"] == 0
    assert row["note"].endswith("FAILED: ValueError: Mosaic says no")
    row["shape"] = shape
    assert "| vit | splash block 256 | FAILED |" in attention_tpu.table([row])


def test_the_splash_variants_skip_the_default_block_and_blocks_past_the_length() -> None:
    encoder, vit = attention_tpu.SHAPES["encoder"], attention_tpu.SHAPES["vit"]
    assert list(attention_tpu._cases(encoder, [256, 512, 1024], False))[4:] == [
        "splash two-kernel bwd",
        "splash block 256",
        "splash block 1024",
    ]  # 512: splash's own block at 1,500 tokens
    assert list(attention_tpu._cases(vit, [256, 512], False))[4:] == ["splash two-kernel bwd"]
    assert list(attention_tpu._cases(vit, None, True)) == list(attention_tpu.IMPLEMENTATIONS)
