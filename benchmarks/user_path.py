"""The headline benchmark: the user's own DataLoader, coreshell at its defaults.

A ``DataLoader`` over scikit-learn's digits (batch 64, shuffled, int64 labels as
``torch.tensor`` makes them), in each of the forms users bring (``_user_path.FORMS``:
a ``TensorDataset`` with a collate that makes a dict, the plain ``TensorDataset``'s tuples,
a map-style ``Dataset`` class read row by row, torchdata's ``StatefulDataLoader``, an
``IterableDataset`` of rows, the user's own batch sampler), is the one loader object every
path reads:

- (a) coreshell exactly as the README writes it: ``JaxModule(MLP(), loss, optimizer)`` under
  ``trainer.fit(module, loader)``; its defaults (``steps_per_call="auto"``, the mesh over every
  JAX device this process has: one CPU device in a plain script, JAX's default);
- (a') coreshell tuned on the same loader (``nan_policy="none"``);
- (b) the pure JAX loop over the loader (numpy hand-over, one jitted step per batch): the
  ceiling of anything this loader feeds;
- (c) Keras 3 on JAX, ``model.fit(loader)``;
- (e) the hand-written Lightning + JAX hybrid (manual optimization, numpy hand-over).

Every Lightning path runs under the same lean Trainer (no logger, bar or checkpoints). Rounds
rotate over every (form, path) pair; the table gives, per form, steps/s per round as median
[min-max] and (a)'s ratio to each peer per round, with the issue's targets. The recipe's own
data modules (gathered batches, ``steps_per_call=8``) are ``train_peers.py``'s rows, labelled apart.

Run: ``.venv/bin/python benchmarks/user_path.py [--rounds 7 --steps 400] [--forms ...] [--tiny]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import jax  # noqa: E402
import torch  # noqa: E402

from benchmarks import _keras_peer, _stats  # noqa: E402
from benchmarks import _user_path as _user  # noqa: E402

if TYPE_CHECKING:
    from torchshell import JaxModule

Row = dict[str, Any]
BATCH = _user.BATCH

USER = "peers/digits MLP, user DataLoader"
USER_A = "(a) coreshell at its defaults"
HYBRID = "(e) hand-written hybrid"
USER_TARGETS = {"(b) pure JAX loop": 0.8, "(c) Keras 3 (JAX)": 1.1, "(e) hand-written hybrid": 1.05}


def bench_name(form: str) -> str:
    """The benchmark's name for one loader form (``peers/digits MLP, user DataLoader: ...``)."""
    return f"{USER}: {form}"


def _mlp() -> Any:
    from jaxcore.models.digits import MLP

    return MLP(features=(256, 256))


def form_paths(form: str, only: str, warmup: int) -> tuple[JaxModule, dict[str, _user.Path]]:
    """Every path on one loader object of ``form``; coreshell as the README writes it."""
    loader = _user.digits_loader(form)
    mlp = _mlp
    # warmup: optimizer steps before the timed ones (compile, the K measurement, windows)
    shell, shell_path = _user.shell_defaults(mlp(), loader, warmup)
    paths = {USER_A: shell_path}
    if not only or "a'" in only.split(","):
        _, paths["(a') coreshell tuned: nan_policy=none"] = _user.shell_defaults(
            mlp(), loader, warmup, nan_policy="none"
        )
    paths |= {
        "(b) pure JAX loop": _user.pure_jax_loader(mlp(), loader),
        "(c) Keras 3 (JAX)": _user.keras_loader(_keras_peer.keras_mlp(), loader, warmup=2),
        HYBRID: _user.hybrid_loader(mlp(), loader, warmup=2),
    }
    if only:  # a smoke run of some paths (coreshell's defaults always)
        keep = {p.strip() for p in only.split(",")} | {"a"}
        paths = {k: v for k, v in paths.items() if k[1:].split(")")[0] in keep}
    return shell, paths


def bench_user_path(
    rounds: int, steps: int, only: str = "", warmup: int = 40, forms: tuple[str, ...] = _user.FORMS
) -> list[Row]:
    """The headline: for each loader form, one loader object read by every path; rounds
    rotate over every (form, path) pair, so load bursts hit all forms alike."""
    shells, paths = {}, {}
    for form in forms:
        shells[form], each = form_paths(form, only, warmup)
        paths |= {(form, name): run for name, run in each.items()}
    keyed = dict(enumerate(paths))
    rates_by_index = _stats.rotate({str(i): paths[k] for i, k in keyed.items()}, rounds, steps)
    rows: list[Row] = []
    for form in forms:
        rates = {name: rates_by_index[str(i)] for i, (f, name) in keyed.items() if f == form}
        rows += _form_rows(form, rates, shells[form])
        if HYBRID in rates:
            rows += host_rows(form, rates, shells[form], paths[form, USER_A], steps)
    return rows


def host_rows(
    form: str, rates: dict[str, list[float]], shell: JaxModule, shell_run: _user.Path, steps: int
) -> list[Row]:
    """The host's own time per step, in µs: a path's step time (per round) minus its compiled
    step fed pre-staged batches. coreshell's is its own step (K per call as it ran); the
    hybrid's is its jitted step. Both include the loader's time, given on its own row."""
    loader = _user.digits_loader(form)
    staged = {
        USER_A: _user.shell_staged_seconds(shell, shell_run, steps),
        HYBRID: _user.hybrid_staged_seconds(_mlp(), loader, steps),
    }
    bench = bench_name(form)
    out = [
        _stats.row(
            bench,
            "the loader alone (iterating it, no step)",
            "µs per batch",
            _user.loader_seconds(loader, steps) * 1e6,
        )
    ]
    for name, seconds in staged.items():
        per_round = [(1 / r - seconds) * 1e6 for r in rates[name]]
        note = f"compiled step fed pre-staged batches: {seconds * 1e6:.0f} µs"
        out.append(_stats.row(bench, f"host time of {name}", "µs per step", per_round, note=note))
    return out


def _form_rows(form: str, rates: dict[str, list[float]], shell: JaxModule) -> list[Row]:
    bench = bench_name(form)
    a = rates[USER_A]
    a_med = statistics.median(a)
    rows: list[Row] = []
    for name, r in rates.items():
        med = statistics.median(r)
        note = f"{med * BATCH:,.0f} samples/s"
        if name == USER_A:
            note += f"; K={shell.window_k} (auto), {shell.mesh.size} device(s)"
        out = _stats.row(
            bench,
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
                bench,
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
    parser.add_argument(
        "--forms",
        default=",".join(_user.FORMS),
        help=f"comma list of loader forms (default: all of {', '.join(_user.FORMS)})",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    quiet = (".*does not have many workers.*", ".*Skipping val loop.*", ".*has `__len__` defined.*")
    for pattern in quiet:  # (Lightning's notes on the user's loaders, not on coreshell)
        warnings.filterwarnings("ignore", pattern)
    warmup = 40
    if args.tiny:
        args.rounds, args.steps, warmup = 1, 8, 8
    forms = tuple(f.strip() for f in args.forms.split(","))
    load_before = _stats.load_average()
    rows = bench_user_path(args.rounds, args.steps, args.only, warmup, forms)
    meta: dict[str, Any] = _stats.machine()
    meta["jax_devices"] = [str(d) for d in jax.devices()]
    meta["torch_threads"] = args.torch_threads
    print(f"load average before: {load_before}, after: {_stats.load_average()}")
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, meta)


if __name__ == "__main__":
    main()
