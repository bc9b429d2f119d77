"""Kill campaign: SIGKILL a real ``coreshell train`` at many points, each followed by
``resume=last``; resumed / bit-identical / lost steps per phase.

A chain starts a fresh run and kills it in one phase after another (mid-step, mid-save,
mid-delete, during validation, during the end-of-run export), each kill followed by
``resume=last`` (the next run of the chain, killed in turn at the next phase); the last run
of the chain finishes. An uninterrupted reference run with the same config keeps every
checkpoint. Each run is watched through ``_phase_probe`` (it prints phase boundaries; the
kill lands a random delay after the boundary of the phase aimed at, within that phase's
measured duration). Per kill point:

- *phase hit*: the phase open when the process died (from the markers it wrote);
- *resumed*: the next run's first step is the newest intact checkpoint's step, no
  half-written checkpoint is chosen (``latest_checkpoint`` only returns verified ones), and
  the ``.tmp-*``/``.old-*`` leftovers of the kill are gone after the next start;
- *bit-identical*: every checkpoint the next run committed exports weights bit-identical to
  the reference's at the same step, its logged losses equal the reference's, and the
  chain's final export equals the reference's;
- *lost steps*: steps done at the kill minus the step resumed from.

Run: ``.venv/bin/python benchmarks/kill_campaign.py [--chains 4] [--max-steps 120]
[--json out.json]`` (4 chains x 5 phases = 20 points, ~15 min on 2 cores).
"""

# ruff: noqa: E402  (imports follow the sys.path fix below)
from __future__ import annotations

import argparse
import json
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Run as a script, this folder comes first on sys.path (benchmarks/bridge.py would shadow
# the bridge package): the repository root instead, so `benchmarks._runs` imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks import _phase_probe, _runs
from torchshell.checkpoint import latest_checkpoint

PHASES = ("mid-step", "mid-save", "mid-delete", "validation", "export")
# The marker that opens each phase, and the one that closes it.
# A save is open from its call until its commit ends (the write goes on in the background).
_OPENS = {"save-start": "save", "delete-start": "delete"}
_OPENS |= {"val-start": "validation", "export-start": "export"}
_CLOSES = {"commit-end": "save", "delete-end": "delete"}
_CLOSES |= {"val-end": "validation", "export-end": "export"}
_TRIGGER = {
    "mid-save": "save-start",
    "mid-delete": "delete-start",
    "validation": "val-start",
    "export": "export-start",
}


def overrides(max_steps: int, every: int = 10, keep: int = 2) -> list[str]:
    """The campaign's run config: digits, a checkpoint every ``every`` steps, validation
    every epoch (~22 steps), the end-of-run export."""
    return [
        "data=digits",
        "model=digits",
        "model.flax.features=[64]",
        f"trainer.max_steps={max_steps}",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=10",
        "trainer.check_val_every_n_epoch=1",
        f"ckpt.every_n_steps={every}",
        f"ckpt.keep={keep}",
        "test_after_fit=false",
    ]


@dataclass
class Point:
    """One kill and what the run after it showed."""

    chain: int
    target: str
    hit: str = "not reached"
    killed: bool = False
    steps_at_kill: int = 0
    resumed_from: int = 0
    lost_steps: int = 0
    leftovers: list[str] = field(default_factory=list)
    resumed: bool = False
    checked_checkpoints: int = 0
    identical: bool = True
    note: str = ""


@dataclass
class Watched:
    """A child run read marker by marker."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    open: list[str] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    ended: bool = False  # the reader's end mark was taken

    def feed(self, line: str, durations: dict[str, list[float]]) -> str | None:
        """Updates the phase state from one line; returns its marker, if any."""
        if not line.startswith(_phase_probe.MARK):
            self.tail = [*self.tail, line][-40:]
            return None
        _, what, step = line.split()
        self.markers.append(what)
        if what == "step":
            self.steps.append(int(step))
        elif what in _OPENS:
            self.open.append(_OPENS[what])
            self.started[what] = time.monotonic()
        elif what in _CLOSES:
            phase = _CLOSES[what]
            if phase in self.open:
                self.open.remove(phase)
            begin = "save-start" if what == "commit-end" else what.replace("-end", "-start")
            if begin in self.started:
                durations.setdefault(begin, []).append(time.monotonic() - self.started[begin])
        return what


def _start(cmd: list[str], cwd: Path) -> Watched:
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_runs.quiet_env(),
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.strip():
                lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return Watched(proc, lines)


def _drain(w: Watched, durations: dict[str, list[float]]) -> None:
    while not w.ended and (line := w.lines.get()) is not None:
        w.feed(line, durations)
    w.ended = True


def _run_and_kill(
    w: Watched, target: str | None, rng: random.Random, durations: dict[str, list[float]]
) -> bool:
    """Watches ``w``; SIGKILLs it in ``target`` (None: lets it finish). True if killed."""
    first_step: int | None = None
    kill_at_step = None
    while True:
        try:
            line = w.lines.get(timeout=600)
        except queue.Empty:
            w.proc.kill()
            raise RuntimeError("no output for 600 s:\n" + "\n".join(w.tail)) from None
        if line is None:
            w.ended = True
            break
        what = w.feed(line, durations)
        if target is None or what is None:
            continue
        if what == "step" and first_step is None:
            first_step = w.steps[-1]
            kill_at_step = first_step + rng.randint(2, 8)
        if target == "mid-step" and what == "step" and w.steps[-1] == kill_at_step:
            time.sleep(rng.uniform(0.0, 0.004))
        elif what == _TRIGGER.get(target) and (target != "mid-save" or w.steps):
            seen = durations.get(what, [0.05])
            time.sleep(rng.uniform(0.0, statistics.median(seen)))
        else:
            continue
        w.proc.send_signal(signal.SIGKILL)
        break
    w.proc.wait()
    _drain(w, durations)
    return w.proc.returncode == -signal.SIGKILL


def _hit(w: Watched) -> str:
    """The phase the process died in, from the markers it wrote before dying."""
    if "export-start" in w.markers:
        return "export"  # the end-of-run export and its publication (the run was done)
    if w.open:
        return {"save": "mid-save", "delete": "mid-delete"}.get(w.open[-1], w.open[-1])
    last = next((m for m in reversed(w.markers) if m != "step"), None)
    return "mid-step" if last in (None, "save-returned") else f"mid-step (after {last})"


def _step_of(path: Path | None) -> int:
    return int(path.name.rsplit("step=", 1)[1].split(".")[0]) if path is not None else 0


def _reference_exports(ref_ckpt: Path) -> dict[int, Path]:
    return {_step_of(p): p / "export" / "model.safetensors" for p in ref_ckpt.glob("*.ckpt")}


def _compare_new_checkpoints(
    ckpt: Path, after: int, reference: dict[int, Path]
) -> tuple[int, bool]:
    checked, same = 0, True
    for path in ckpt.glob("*.ckpt"):
        step = _step_of(path)
        if step > after and step in reference and (path / "manifest.json").is_file():
            checked += 1
            same &= _runs.same_weights(path / "export" / "model.safetensors", reference[step])
    return checked, same


def _losses_match(tmp: Path, name: str, ref: dict[int, float]) -> bool:
    got = _runs.losses(tmp, name)
    return all(ref.get(s) == v for s, v in got.items())


def log(text: str) -> None:
    """A progress line on stderr."""
    print(f"[kill_campaign {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def campaign(
    tmp: Path, chains: int, max_steps: int, seed: int = 0, phases: tuple[str, ...] = PHASES
) -> list[Point]:
    """Runs the reference and ``chains`` chains of kills (one per phase of ``phases``, in
    that order); returns every kill point."""
    rng = random.Random(seed)
    cli = _runs.cli_module()
    probe = _phase_probe.launcher(cli)
    ref_ckpt = tmp / "ck_reference"
    _runs.run_ok(
        _runs.train_cmd(tmp, "reference", *overrides(max_steps, keep=1000), f"ckpt.dir={ref_ckpt}"),
        tmp,
    )
    reference = _reference_exports(ref_ckpt)
    log(f"reference run done: checkpoints at steps {sorted(reference)}")
    ref_losses = _runs.losses(tmp, "reference")
    ref_final = tmp / "reference" / "export" / "model.safetensors"
    durations: dict[str, list[float]] = {}
    points: list[Point] = []
    for c in range(chains):
        ckpt = tmp / f"ck_chain{c}"
        chain_points: list[Point] = []
        prev: Point | None = None
        for i, target in enumerate([*phases, None]):
            name = f"chain{c}-run{i}"
            extra = [f"ckpt.dir={ckpt}"] + (["resume=last"] if i else [])
            w = _start(_runs.train_cmd(tmp, name, *overrides(max_steps), *extra, prefix=probe), tmp)
            killed = _run_and_kill(w, target, rng, durations)
            log(
                f"{name}: aimed at {target}, exit {w.proc.returncode}, steps "
                f"{w.steps[:1]}..{w.steps[-1:]}, open {w.open}"
            )
            if prev is not None:  # what this run shows about the kill before it
                first = w.steps[0] if w.steps else max_steps  # none: resumed at the end
                prev.resumed = first == prev.resumed_from
                prev.resumed &= not any((ckpt / n).exists() for n in prev.leftovers)
                checked, same = _compare_new_checkpoints(ckpt, prev.resumed_from, reference)
                prev.checked_checkpoints = checked
                prev.identical = same and _losses_match(tmp, name, ref_losses)
            if target is None:
                final = tmp / name / "export" / "model.safetensors"
                if w.proc.returncode != 0 and prev is not None:  # the resume itself failed
                    prev.resumed = False
                    prev.note = f"resume=last exited {w.proc.returncode}: {w.tail[-1:]}"
                    newest = latest_checkpoint(ckpt, log=lambda _: None)
                    final = (newest or ckpt) / "export" / "model.safetensors"
                    ref_at = reference.get(_step_of(newest))
                    final_same = ref_at is not None and _runs.same_weights(final, ref_at)
                elif w.proc.returncode != 0:
                    raise RuntimeError(f"{name} failed:\n" + "\n".join(w.tail))
                else:
                    final_same = _runs.same_weights(final, ref_final)
                for p in chain_points:
                    p.identical &= final_same
                break
            point = Point(c, target)
            if not killed:
                point.note = f"the run ended (exit {w.proc.returncode}) before the phase"
                chain_points.append(point)
                prev = None
                if w.proc.returncode != 0:
                    raise RuntimeError(f"{name} failed:\n" + "\n".join(w.tail))
                break
            point.killed = True
            point.hit = _hit(w)
            point.steps_at_kill = w.steps[-1] + 1 if w.steps else 0  # done or started
            newest = latest_checkpoint(ckpt, log=lambda _: None)
            point.resumed_from = _step_of(newest)
            point.lost_steps = max(point.steps_at_kill - point.resumed_from, 0)
            point.leftovers = sorted(
                p.name for p in ckpt.glob(".*") if p.name.startswith((".tmp-", ".old-"))
            )
            chain_points.append(point)
            prev = point
        points += chain_points
    return points


def table(points: list[Point]) -> str:
    """Markdown: per phase aimed at, points, phases hit, resumed, bit-identical, lost steps."""
    rows = [
        "| phase aimed at | points | phase hit (count) | resumed | bit-identical "
        "| lost steps median [max] |",
        "|---|---|---|---|---|---|",
    ]
    for phase in PHASES:
        ps = [p for p in points if p.target == phase and p.killed]
        if not ps:
            continue
        hits: dict[str, int] = {}
        for p in ps:
            hits[p.hit] = hits.get(p.hit, 0) + 1
        lost = [p.lost_steps for p in ps]
        rows.append(
            f"| {phase} | {len(ps)} | {', '.join(f'{k} {v}' for k, v in sorted(hits.items()))} "
            f"| {sum(p.resumed for p in ps)}/{len(ps)} | {sum(p.identical for p in ps)}/{len(ps)} "
            f"| {statistics.median(lost):g} [{max(lost)}] |"
        )
    killed = [p for p in points if p.killed]
    rows.append(
        f"| all | {len(killed)} | | {sum(p.resumed for p in killed)}/{len(killed)} "
        f"| {sum(p.identical for p in killed)}/{len(killed)} | |"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4, help="5 kill points per chain")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every point here")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        points = campaign(Path(tmp), args.chains, args.max_steps, args.seed)
    print(table(points))
    print(f"\n{len(points)} points, {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in points], indent=1))


if __name__ == "__main__":
    main()
