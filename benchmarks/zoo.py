"""The model zoo table: each public model's parity through the jaxcore step, and its speed.

For every entry of ``tests/zoo/models.py``: 3 SGD steps through ``torch_model_fns`` +
``jaxcore.make_train_step`` against ``torch.optim.SGD`` on the same module and batches (max
relative parameter/buffer difference, fp32; a net whose torch-vs-torch spread exceeds 1e-3
is "chaotic: not judged"), the strict ``load_state_dict`` of the trained
weights into a fresh instance, and the median step time of the jitted step against plain
torch eager (forward + backward + SGD) on the same batch. One JAX CPU device.

    .venv/bin/python benchmarks/zoo.py --write docs/zoo.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BEGIN, END = "<!-- zoo:begin -->", "<!-- zoo:end -->"


def run_entry(entry, rounds: int) -> dict:
    from tests.zoo.harness import classify
    from tests.zoo.models import build

    net, batches = build(entry)
    return classify(net, batches, entry, rounds)


def table(rows: list[tuple]) -> str:
    n_ok = sum(r[2]["result"] == "parity" for r in rows)
    lines = [
        BEGIN,
        f"**{n_ok} of {len(rows)} train with parity ({100 * n_ok / len(rows):.0f}%).**",
        "",
        "| model | source | result | max rel diff | torch vs torch (1e-7 change, worst step) "
        "| step ms "
        "(torchax, jitted) | step ms (torch eager) | torch / torchax | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, source, r in rows:
        rel = f"{r['max_rel']:.1e}" if "max_rel" in r else "-"
        floor = r.get("torch_floor_max", r.get("torch_floor"))
        own = f"{floor:.1e}" if floor is not None else "-"
        jm, tm = r.get("jax_ms"), r.get("torch_ms")
        speed = f"{tm / jm:.2f}" if jm and tm and jm == jm else "-"
        fmt = lambda v: f"{v:.2f}" if v is not None and v == v else "-"  # noqa: E731
        reason = r.get("reason", "").replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {name} | {source} | {r['result']} | {rel} | {own} | {fmt(jm)} | {fmt(tm)} "
            f"| {speed} | {reason} |"
        )
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace the table between the markers")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per model (median)")
    ap.add_argument("--only", default="", help="substring of the model names to run")
    ap.add_argument("--cache", type=Path, help="JSON of finished rows: reused, extended")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    import json

    from tests.zoo.models import zoo

    done = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    rows = []
    for entry in zoo():
        if args.only and args.only not in entry.name:
            continue
        r = done.get(entry.name) or run_entry(entry, args.rounds)
        done[entry.name] = r
        if args.cache:
            args.cache.write_text(json.dumps(done, indent=1))
        print(
            f"{entry.name:60s} {r['result']:15s} {r.get('max_rel', '-')!s:24s} "
            f"{r['seconds']:.1f}s {r.get('reason', '')[:150]}",
            flush=True,
        )
        rows.append((entry.name, entry.source, r))
    text = table(rows)
    if args.write:
        doc = args.write.read_text() if args.write.exists() else f"{BEGIN}\n{END}\n"
        head, rest = doc.split(BEGIN, 1)
        args.write.write_text(head + text + rest.split(END, 1)[1])
    else:
        print(text)


if __name__ == "__main__":
    main()
