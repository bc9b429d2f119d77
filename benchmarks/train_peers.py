"""Training throughput side by side: coreshell against what users would pick instead.

For each recipe (the digits MLP, overhead-dominated; the spoken-digits encoder,
compute-dominated), with the same model, data and batch size (64 rows per optimizer step):

- (a) coreshell: torch DataLoader -> Lightning -> ``JaxModule`` (bridge, jitted jaxcore step,
  ``steps_per_call=K``, batch sharded over the recipe's CPU devices: one per core for the
  encoder, one for the MLP);
- (b) a pure JAX/optax loop over the same batches already on the device (one jitted step
  per batch, one device: what a JAX user writes), and "(b) like (a)": the same step run as
  (a) runs it (``lax.scan`` over K batches per call, batch over (a)'s devices), the ceiling
  of (a)'s own execution;
- (c) Keras 3 on the JAX backend, ``fit`` on the same torch DataLoader (through numpy);
- (d) PyTorch Lightning training the torch twin (torch Adam);
- (e) Lightning manual optimization around a jitted JAX step with a numpy hand-over.

Rounds rotate between the paths (each excludes its own warm-up); the table gives steps/s per
round as median [min-max], (a)'s ratio to every peer per round, and the time split of (a)
from separate instrumented rounds.

Run: ``.venv/bin/python benchmarks/train_peers.py`` (``--tiny`` for a smoke run,
``--json PATH`` to write the rows).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

# Scripts here are named like the packages they measure (bridge.py): drop this folder from the
# import path so that `import bridge` finds the package, and load the `_*.py` helpers by file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import jax  # noqa: E402
import torch  # noqa: E402

import jaxcore  # noqa: E402

jaxcore.set_cpu_devices("auto")  # before JAX starts; the peers use the first device only

from benchmarks import _keras_peer, _peers, _recipes, _stats  # noqa: E402
from benchmarks import _shell_peer as _shell  # noqa: E402

Row = dict[str, Any]
BATCH, RECIPES, materialize = _recipes.BATCH, _recipes.RECIPES, _recipes.materialize

A = "(a) coreshell"
TARGETS = {
    "mlp": {"(b) pure JAX": 0.8, "(c) Keras 3 (JAX)": 1.1, "(e) hand-written hybrid": 1.2},
    "encoder": {"(b) pure JAX": 0.95, "(c) Keras 3 (JAX)": 1.1, "(e) hand-written hybrid": 1.2},
}
DEFAULT_STEPS = {"mlp": 480, "encoder": 12}
# steps_per_call per recipe: on CPU a lax.scan over the encoder step measured ~7x slower per
# step than one call per step (XLA CPU runs the loop body without its fast paths), so the
# compute-dominated encoder gets K=1; the overhead-dominated MLP needs K>1.
DEFAULT_K = {"mlp": 8, "encoder": 1}
# (a)'s devices per recipe (0: all, one per core; ``jaxcore.set_cpu_devices("auto")`` below):
# the encoder's step is 1.7x faster data-parallel over one device per core than on one device
# (XLA's intra-op pool uses 2 cores poorly on its small kernels); the MLP's is 2.3x slower
# (a gradient all-reduce per step costs more than its ~0.4 ms of math).
DEFAULT_DEVICES = {"mlp": 1, "encoder": 0}


def bench_recipe(
    key: str, rounds: int, steps: int, k: int, devices: int, split_repeats: int
) -> list[Row]:
    recipe = RECIPES[key]()
    bench = f"peers/{recipe.name}"
    k = k if _shell.supports_steps_per_call() else 1
    steps = max(k, steps // k * k)
    warmup = 2 * k  # optimizer steps; the first call compiles
    inputs = recipe.inputs
    batches = materialize(recipe.datamodule(BATCH))
    mesh = jaxcore.make_mesh({"data": -1}, num_devices=devices or None)
    module = _shell.make_module(recipe.flax(), inputs, k, mesh)
    like_a = f"(b) pure JAX like (a): K={k}, {mesh.size} device(s)"
    shell_dm = recipe.datamodule(BATCH * k)

    keras_dm = recipe.datamodule(BATCH)
    keras_dm.setup("fit")
    keras_loader = keras_dm.train_dataloader()
    keras_loader.collate_fn = _keras_peer.TupleCollate(inputs)

    paths = {
        f"{A}, K={k}, {mesh.size} device(s)": _shell.shell_path(module, shell_dm, warmup),
        "(b) pure JAX": _peers.pure_jax_path(recipe.flax(), inputs, batches),
        like_a: _peers.pure_jax_path(recipe.flax(), inputs, batches, k, mesh),
        "(c) Keras 3 (JAX)": _keras_peer.keras_path(recipe.keras(), keras_loader, warmup=2),
        "(d) PyTorch Lightning": _peers.lightning_twin_path(
            recipe.twin(), inputs, recipe.datamodule(BATCH), warmup=2
        ),
        "(e) hand-written hybrid": _peers.hybrid_path(
            recipe.flax(), inputs, recipe.datamodule(BATCH), warmup=2
        ),
    }
    rates = _stats.rotate(paths, rounds, steps)
    a_name = f"{A}, K={k}, {mesh.size} device(s)"
    a = rates[a_name]
    a_med = statistics.median(a)
    rows: list[Row] = []
    for name, r in rates.items():
        med = statistics.median(r)
        out = _stats.row(
            bench,
            name,
            "steps/s",
            r,
            ratio=None if name == a_name else a_med / med,
            ratio_to=None if name == a_name else "(a) / this",
            note=f"{med * BATCH:,.0f} samples/s",
        )
        out["samples_per_s"] = med * BATCH
        rows.append(out)
    for name, r in rates.items():
        if name == a_name:
            continue
        per_round = [x / y for x, y in zip(a, r, strict=True)]
        target = TARGETS[key].get(name)
        rows.append(
            _stats.row(
                bench,
                f"a/{name.split(')')[0].lstrip('(')}{' like (a)' if name == like_a else ''}",
                "ratio per round",
                per_round,
                note=f"target >= {target}" if target else "",
            )
        )
    splits = [_shell.split_round(module, shell_dm, warmup, steps) for _ in range(split_repeats)]
    total = statistics.median(s["total"] for s in splits)
    for part in ("data wait", "bridge", "compute", "loop overhead", "total"):
        values = [s[part] for s in splits]
        share = statistics.median(values) / total
        rows.append(
            _stats.row(
                bench,
                f"(a) split: {part}",
                "µs/step",
                values,
                note=f"{share:.0%} of the instrumented step" if part != "total" else "",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,encoder", help="comma list of: mlp, encoder")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=0, help="steps per round (0: per recipe)")
    parser.add_argument("--k", type=int, default=0, help="coreshell steps_per_call (0: per recipe)")
    parser.add_argument(
        "--devices", type=int, default=-1, help="coreshell's CPU devices (0: all; -1: per recipe)"
    )
    parser.add_argument("--split-repeats", type=int, default=5)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared 2-core machine torch's OpenMP pool "
        "collapses under load)",
    )
    parser.add_argument("--tiny", action="store_true", help="smoke run: 1 round, few steps")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for pattern in (".*does not have many workers.*", ".*Skipping val loop.*", ".*shuffle=True.*"):
        warnings.filterwarnings("ignore", pattern)
    if args.tiny:
        args.rounds, args.split_repeats = 1, 1
    rows: list[Row] = []
    for key in args.models.split(","):
        steps = args.steps or (8 if args.tiny else DEFAULT_STEPS[key])
        k = args.k or (min(DEFAULT_K[key], 2) if args.tiny else DEFAULT_K[key])
        devices = DEFAULT_DEVICES[key] if args.devices < 0 else args.devices
        rows += bench_recipe(key, args.rounds, steps, k, devices, args.split_repeats)
    meta: dict[str, Any] = _stats.machine()
    meta["jax_devices"] = [str(d) for d in jax.devices()]
    meta["torch_threads"] = args.torch_threads
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, meta)


if __name__ == "__main__":
    main()
