"""What checkpoints cost the training loop: a checkpoint every 10 steps vs none.

Each round runs the real ``coreshell train`` once per case, in a rotating order, on the
spoken-digits recipe (``--recipe digits`` for the MLP): ``ckpt.every_n_steps=0`` (off) and
``ckpt.every_n_steps=10`` (asynchronous saves: Orbax state, ``lightning.pt``, the torch
export and the config, manifest, rename; ``ckpt.keep=2``, so a removal per save too).
The step time is read from the run's own ``system/coreshell.perf.steps_per_s`` (wall time
between logging steps, every 10 steps: each interval holds exactly one checkpoint), the
first intervals (compile, first batches) excluded. Prints medians with the min-max spread
over the rounds and the ratio to ``off``.

    .venv/bin/python benchmarks/checkpoint_cost.py --rounds 3 --steps 300
"""

# ruff: noqa: E402  (imports follow the sys.path fix below)
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks import _runs, _stats

CASES = {"off": "ckpt.every_n_steps=0", "every 10 steps (async)": "ckpt.every_n_steps=10"}


def step_ms(tmp: Path, name: str, recipe: str, steps: int, warmup: int, case: str) -> float:
    """Mean ms per step of one run, after ``warmup`` logging intervals."""
    _runs.run_ok(
        _runs.train_cmd(
            tmp,
            name,
            f"data={recipe}",
            f"model={recipe}",
            f"trainer.max_steps={steps}",
            "trainer.max_epochs=-1",
            "trainer.enable_progress_bar=false",
            "trainer.log_every_n_steps=10",
            "trainer.check_val_every_n_epoch=1000",
            "test_after_fit=false",
            case,
            "ckpt.keep=2",
            f"ckpt.dir={tmp}/ck_{name}",
        ),
        tmp,
    )
    rates = _runs.losses(tmp, name, "system/coreshell.perf.steps_per_s")
    kept = [rates[s] for s in sorted(rates)][warmup:]
    if not kept:
        raise RuntimeError(
            f"{name}: no system/coreshell.perf.steps_per_s after {warmup} intervals: {rates}"
        )
    return 1e3 * statistics.mean(1.0 / r for r in kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="spoken_digits")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=3, help="logging intervals skipped")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        names = list(CASES)
        for r in range(args.rounds):
            for case in names[r % len(names) :] + names[: r % len(names)]:
                run = f"r{r}-{case.split()[0]}"
                samples[case].append(
                    step_ms(Path(tmp), run, args.recipe, args.steps, args.warmup, CASES[case])
                )
    off = statistics.median(samples["off"])
    rows = [
        _stats.row(
            f"checkpoint/{args.recipe}",
            case,
            "ms/step",
            values,
            ratio=statistics.median(values) / off,
            ratio_to="off",
        )
        for case, values in samples.items()
    ]
    print(
        f"checkpoint cost, {args.recipe}, {args.steps} steps, {args.rounds} rounds, load "
        f"average {_stats.load_average()[0]:.1f}\n"
    )
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
