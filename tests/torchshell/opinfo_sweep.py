"""torch's whole op database (``op_db``) through coreshell's trace: the table of
docs/torch_model.md (``make opinfo``).

Every op that supports float32 and autograd on CPU runs its first two samples with non-empty
tensors through :func:`tests.torchshell.opinfo_harness.compare` (values and gradients against
torch eager). The ops run in worker processes of ``--chunk`` ops each, ``--jobs`` at a time;
an op that crashes its worker or runs past ``--timeout`` seconds is run again alone, and is
marked ``crashed`` if it does so again; the rest of its chunk goes on in a new worker.

    python -m tests.torchshell.opinfo_sweep                   # all ops: rewrites the table
    python -m tests.torchshell.opinfo_sweep --ops polygamma,linalg.lstsq   # their rows only

``--ops`` takes op names (every variant) or ``name:variant``; their rows replace theirs in
the table, and the totals are summed again.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.torchshell import opinfo_table as table
from tests.torchshell.opinfo_harness import Outcome

DOC = table.ROOT / "docs" / "torch_model.md"
Key = tuple[str, str]
_STARTUP = 180.0  # seconds a worker may take to import torch, JAX and op_db


def _op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def _worker(keys: Sequence[Key], results: Path, count: int) -> None:
    """Runs ``keys`` in order, one JSON line per op start and per op result."""
    from tests.torchshell.opinfo_harness import compare, draws, samples

    by_key = {(op.name, op.variant_test_name): op for op in _op_db()}
    with results.open("a") as out:
        out.write(json.dumps({"ready": True}) + "\n")  # (imports done: the ops' clock starts)
        out.flush()
        for key in keys:
            out.write(json.dumps({"start": key}) + "\n")
            out.flush()
            op, began = by_key[key[0], key[1]], time.monotonic()
            try:
                found = [compare(op, s, random=draws(op)) for s in samples(op, count)]
            except Exception as e:  # (torch's sample_inputs itself: nothing to compare)
                found = [Outcome("skipped", f"sample_inputs: {type(e).__name__}: {e}")]
            outcomes = [dataclasses.astuple(o) for o in found]
            seconds = round(time.monotonic() - began, 1)
            out.write(json.dumps({"op": key, "outcomes": outcomes, "s": seconds}) + "\n")
            out.flush()


@dataclasses.dataclass
class _Run:
    """A worker process running ``keys`` (``alone``: one op run again after a crash)."""

    keys: list[Key]
    alone: bool
    proc: subprocess.Popen[bytes]
    results: Path
    log: Path
    last: float  # when it last reported
    done: dict[Key, list[Outcome]] = dataclasses.field(default_factory=dict)
    seconds: dict[Key, float] = dataclasses.field(default_factory=dict)

    seen: int = 0  # result lines read

    def poll(self) -> None:
        lines = self.results.read_text().split("\n")[:-1]  # (complete lines only)
        for line in lines[self.seen :]:
            entry = json.loads(line)
            if "outcomes" in entry:
                key = (entry["op"][0], entry["op"][1])
                self.done[key] = [Outcome(*o) for o in entry["outcomes"]]
                self.seconds[key] = entry["s"]
        if len(lines) > self.seen:
            self.last, self.seen = time.monotonic(), len(lines)

    def why(self, timed_out: float | None) -> str:
        if timed_out is not None:
            return f"ran past {timed_out:.0f} s (--timeout)"
        tail = [s for s in self.log.read_text(errors="replace").splitlines() if s.strip()]
        return f"the worker exited {self.proc.returncode}: {tail[-1] if tail else ''}"


class Sweep:
    """Runs ops in worker processes and collects their outcomes (:meth:`run`)."""

    def __init__(self, *, jobs: int, chunk: int, timeout: float, count: int) -> None:
        self.jobs, self.chunk, self.timeout, self.count = jobs, chunk, timeout, count
        self.outcomes: dict[Key, list[Outcome]] = {}
        self.crashed: dict[Key, str] = {}
        self.seconds: dict[Key, float] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="coreshell-opinfo-"))  # (workers' logs)
        self.started = itertools.count()

    def _start(self, keys: list[Key], alone: bool) -> _Run:
        n = next(self.started)
        results, log = self.tmp / f"run{n}.jsonl", self.tmp / f"run{n}.log"
        results.touch()
        cmd = [sys.executable, "-m", __spec__.name if __spec__ else "tests.torchshell.opinfo_sweep"]
        cmd += ["--worker", str(results), "--count", str(self.count), "--keys", json.dumps(keys)]
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")  # (the samples are CPU tensors, float32)
        with log.open("wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=table.ROOT, env=env, stdout=err, stderr=err, start_new_session=True
            )
        return _Run(keys, alone, proc, results, log, time.monotonic())

    def run(self, keys: Sequence[Key]) -> None:
        """Runs ``keys``; fills :attr:`outcomes`, :attr:`crashed` and :attr:`seconds`."""
        queue = collections.deque(
            (list(keys[i : i + self.chunk]), False) for i in range(0, len(keys), self.chunk)
        )
        running: list[_Run] = []
        total = len(keys)
        while queue or running:
            while queue and len(running) < self.jobs:
                running.append(self._start(*queue.popleft()))
            time.sleep(0.5)
            for r in list(running):
                r.poll()
                exited = r.proc.poll() is not None
                allowed = self.timeout + (0 if r.seen else _STARTUP)  # (imports first)
                late = time.monotonic() - r.last > allowed
                if not exited and not late:
                    continue
                if not exited:
                    os.killpg(r.proc.pid, signal.SIGKILL)  # (the worker this sweep started)
                    r.proc.wait()
                    r.poll()
                running.remove(r)
                self.outcomes.update(r.done)
                self.seconds.update(r.seconds)
                left = [k for k in r.keys if k not in r.done]
                if left:  # the first one left crashed the worker or hung
                    if r.alone:
                        self.crashed[left[0]] = r.why(self.timeout if late else None)
                    else:
                        queue.appendleft(([left[0]], True))
                    if left[1:]:
                        queue.append((left[1:], False))
                done = len(self.outcomes) + len(self.crashed)
                print(f"opinfo: {done}/{total} ops", file=sys.stderr, flush=True)

    def rows(self, keys: Sequence[Key]) -> list[table.Row]:
        """A row per key: its outcomes', or ``crashed``."""
        return [
            table.Row(*k, status="crashed", note=self.crashed[k])
            if k in self.crashed
            else table.row(*k, self.outcomes[k])
            for k in keys
        ]


def _chosen(ops: str | None, db: list[Any]) -> list[Any]:
    if not ops:
        return db
    wanted = [w.strip() for w in ops.split(",") if w.strip()]
    chosen = [op for op in db if op.name in wanted or f"{op.name}:{op.variant_test_name}" in wanted]
    known = {op.name for op in db} | {f"{op.name}:{op.variant_test_name}" for op in db}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"not in this torch's op_db: {unknown} (names, or name:variant)")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m tests.torchshell.opinfo_sweep")
    p.add_argument("--ops", help="comma-separated op names (or name:variant): these rows only")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--chunk", type=int, default=40, help="ops per worker process")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one op may take")
    p.add_argument("--count", type=int, default=2, help="samples per op")
    p.add_argument("--out", type=Path, default=DOC, help="the markdown file with the table")
    p.add_argument("--json", type=Path, help="also write every sample's outcome here")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker([(k[0], k[1]) for k in json.loads(args.keys)], args.worker, args.count)
        return 0

    import torch

    from tests.torchshell.opinfo_harness import in_scope

    db = _chosen(args.ops, _op_db())
    swept = [(op.name, op.variant_test_name) for op in db if in_scope(op)]
    sweep = Sweep(jobs=args.jobs, chunk=args.chunk, timeout=args.timeout, count=args.count)
    began = time.monotonic()
    sweep.run(swept)
    rows = sweep.rows(swept) + [
        table.Row(op.name, op.variant_test_name, status="not swept")
        for op in db
        if not in_scope(op)
    ]
    version = torch.__version__.split("+")[0]
    if args.ops:  # (these rows into the table as it is)
        old, _ = table.parse(table.block(args.out.read_text()))
        new = {r.key: r for r in rows}
        rows = [new.pop(r.key, r) for r in old] + list(new.values())
    args.out.write_text(table.replaced(args.out.read_text(), table.render(rows, version)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    f"{k[0]}:{k[1]}": [dataclasses.astuple(o) for o in v]
                    for k, v in sorted(sweep.outcomes.items())
                }
                | {f"{k[0]}:{k[1]}": v for k, v in sorted(sweep.crashed.items())},
                indent=1,
            )
        )
    if not sweep.crashed:
        shutil.rmtree(sweep.tmp)
    else:
        print(f"opinfo: the crashed workers' logs: {sweep.tmp}", file=sys.stderr)
    slow = sorted(sweep.seconds.items(), key=lambda kv: -kv[1])[:5]
    print(f"opinfo: {time.monotonic() - began:.0f} s; slowest: {slow}", file=sys.stderr)
    print(table.render(rows, version).splitlines()[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
