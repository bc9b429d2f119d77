"""Start-up of ``coreshell train`` as a user's shell runs it: ``import torchshell`` and the
seconds from launching the process to the end of its first training step, cold (an empty
compile cache) and warm (the same cache again).

Each repeat makes an empty cache directory and runs the digits recipe (Flax MLP) twice on it
for 2 steps, without checkpoints or the test pass. The first step's end is read from the
run's own progress bar (its first ``on_train_batch_end``), so the figure includes Python's
start, the imports, Hydra, the data, the init and step compiles and one step. Medians and
min-max over the repeats; the load average is printed beside them.

    .venv/bin/python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the child: the real CLI, with its progress bar noting when the first step has ended
_CHILD = """
import sys, time
t0 = float(sys.argv[1])
from torchshell.app import console
seen = console.RunProgressBar.on_train_batch_end
def first(self, trainer, module, *args):
    if not getattr(self, "_first_noted", False):
        self._first_noted = True
        print(f"FIRST_STEP {time.time() - t0:.3f}", file=sys.stderr, flush=True)
    seen(self, trainer, module, *args)
console.RunProgressBar.on_train_batch_end = first
from torchshell.app.cli import main
main(sys.argv[2:])
"""


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def import_seconds(module: str) -> float:
    """Wall seconds of ``python -c "import MODULE"`` in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)
    return time.perf_counter() - t0


def first_step_seconds(work: Path, cache: Path) -> float:
    """Seconds from launching ``coreshell train`` (digits, 2 steps) to its first step's end."""
    work.mkdir(parents=True)
    args = [
        "train",
        "recipe=digits",
        "trainer.max_steps=2",
        "ckpt.every_n_steps=0",
        "test_after_fit=false",
        f"tracking.uri=sqlite:///{work}/mlflow.db",
        f"hydra.run.dir={work}/run",
    ]
    env = {**os.environ, "CORESHELL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(t0), *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stderr.splitlines():
        if line.startswith("FIRST_STEP "):
            return float(line.split()[1])
    raise RuntimeError(
        f"expected a FIRST_STEP line from the run, got exit {proc.returncode}: "
        f"{proc.stderr[-2000:]}\nfix: run the command by hand in {work}"
    )


def main() -> None:
    """Prints the medians [min-max] of each figure over ``--repeats`` repeats."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    imports = {m: [import_seconds(m) for _ in range(5)] for m in ("torchshell", "lightning")}
    cold: list[float] = []
    warm: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            cache = Path(tmp) / f"cache{r}"
            cold.append(first_step_seconds(Path(tmp) / f"cold{r}", cache))
            warm.append(first_step_seconds(Path(tmp) / f"warm{r}", cache))
            print(f"repeat {r}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s", flush=True)
    for module, xs in imports.items():
        print(f'python -c "import {module}": {_stats(xs)} s (5 runs)')
    print(f"launch to the end of the first step, cold: {_stats(cold)} s")
    print(f"launch to the end of the first step, warm: {_stats(warm)} s")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
