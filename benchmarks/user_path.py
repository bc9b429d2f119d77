"""The headline benchmark: the user's own DataLoader, coreshell at its defaults.

One ``DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)`` over scikit-learn's digits
(int64 labels, as ``torch.tensor`` makes them) is the one loader object every path reads:

- (a) coreshell exactly as the README writes it: ``JaxModule(MLP(), loss, optimizer)`` under
  ``trainer.fit(module, loader)``; its defaults (``steps_per_call="auto"``, the mesh over every
  JAX device this process has: one CPU device in a plain script, JAX's default);
- (a') coreshell tuned on the same loader (``nan_policy="none"``);
- (b) the pure JAX loop over the loader (numpy hand-over, one jitted step per batch): the
  ceiling of anything this loader feeds;
- (c) Keras 3 on JAX, ``model.fit(loader)``;
- (e) the hand-written Lightning + JAX hybrid (manual optimization, numpy hand-over).

Every Lightning path runs under the same lean Trainer (no logger, bar or checkpoints). Rounds
rotate between the paths; the table gives steps/s per round as median [min-max] and (a)'s
ratio to each peer per round, with the issue's targets. The recipe's own data modules
(gathered batches, ``steps_per_call=8``) are ``train_peers.py``'s rows, labelled apart.

Run: ``.venv/bin/python benchmarks/user_path.py [--rounds 7 --steps 400] [--tiny]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import jax  # noqa: E402
import torch  # noqa: E402

from benchmarks import _keras_peer, _stats  # noqa: E402
from benchmarks import _user_path as _user  # noqa: E402

Row = dict[str, Any]
BATCH = _user.BATCH

USER = "peers/digits MLP, user DataLoader"
USER_A = "(a) coreshell at its defaults"
USER_TARGETS = {"(b) pure JAX loop": 0.8, "(c) Keras 3 (JAX)": 1.1, "(e) hand-written hybrid": 1.2}


def bench_user_path(rounds: int, steps: int, only: str = "", warmup: int = 40) -> list[Row]:
    """The headline: one ``DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)``
    object read by every path; coreshell exactly as the README writes it, and tuned."""
    from jaxcore.models.digits import MLP

    loader = _user.digits_loader()
    # warmup: optimizer steps before the timed ones (compile, the K measurement, windows)
    mlp = lambda: MLP(features=(256, 256))  # noqa: E731
    shell, shell_path = _user.shell_defaults(mlp(), loader, warmup)
    _, tuned_path = _user.shell_defaults(mlp(), loader, warmup, nan_policy="none")
    paths = {
        USER_A: shell_path,
        "(a') coreshell tuned: nan_policy=none": tuned_path,
        "(b) pure JAX loop": _user.pure_jax_loader(mlp(), loader),
        "(c) Keras 3 (JAX)": _user.keras_loader(_keras_peer.keras_mlp(), loader, warmup=2),
        "(e) hand-written hybrid": _user.hybrid_loader(mlp(), loader, warmup=2),
    }
    if only:  # a smoke run of some paths (coreshell's defaults always)
        keep = {p.strip() for p in only.split(",")} | {"a"}
        paths = {k: v for k, v in paths.items() if k[1:].split(")")[0] in keep}
    rates = _stats.rotate(paths, rounds, steps)
    a = rates[USER_A]
    a_med = statistics.median(a)
    rows: list[Row] = []
    for name, r in rates.items():
        med = statistics.median(r)
        note = f"{med * BATCH:,.0f} samples/s"
        if name == USER_A:
            note += f"; K={shell.window_k} (auto), {shell.mesh.size} device(s)"
        out = _stats.row(
            USER,
            name,
            "steps/s",
            r,
            ratio=None if name == USER_A else a_med / med,
            ratio_to=None if name == USER_A else "(a) / this",
            note=note,
        )
        out["samples_per_s"] = med * BATCH
        rows.append(out)
    for name, r in rates.items():
        if name == USER_A:
            continue
        per_round = [x / y for x, y in zip(a, r, strict=True)]
        target = USER_TARGETS.get(name)
        rows.append(
            _stats.row(
                USER,
                f"a/{name.split(')')[0].lstrip('(')}",
                "ratio per round",
                per_round,
                note=f"target >= {target}" if target else "",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400, help="timed steps per round")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: torch's own default, what a user runs with; torch's "
        "threads waiting for cores a step holds showed only there)",
    )
    parser.add_argument("--tiny", action="store_true", help="smoke run: 1 round, few steps")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--only", default="", help="comma list of paths: a, a', b, c, e")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for pattern in (".*does not have many workers.*", ".*Skipping val loop.*"):
        warnings.filterwarnings("ignore", pattern)
    warmup = 40
    if args.tiny:
        args.rounds, args.steps, warmup = 1, 8, 8
    rows = bench_user_path(args.rounds, args.steps, args.only, warmup)
    meta: dict[str, Any] = _stats.machine()
    meta["jax_devices"] = [str(d) for d in jax.devices()]
    meta["torch_threads"] = args.torch_threads
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, meta)


if __name__ == "__main__":
    main()
