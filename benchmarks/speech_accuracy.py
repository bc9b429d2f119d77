"""Speech recipe accuracy across seeds, and on a held-out set made apart, through the served model.

For each seed: ``coreshell train seed=S`` at the default config (no other override) in a
scratch folder, then from its MLflow run: the test accuracy and the test split's size
(``test/examples``), the training throughput, the time of fit and the load average around it
(the machine is shared: time figures are only meaningful beside the load; the CPU seconds of
the whole command over the 2 cores bound its time on an idle machine). Then the held-out
set (:func:`torchshell.data._spoken_digits_heldout.ensure_heldout`: voices in no split,
prosody extremes, 15 dB noise, leading silence) is scored through the run's MLflow model
(``mlflow.pyfunc.load_model("runs:/<id>/model")``, the request ``{waveform, lengths}``),
per condition.

    .venv/bin/python benchmarks/speech_accuracy.py --seeds 0 1 2
    .venv/bin/python benchmarks/speech_accuracy.py --score DIR/mlflow.db:RUN_ID   # no training
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def train(seed: int, work: Path, extra: list[str]) -> dict[str, Any]:
    """Runs ``coreshell train seed=S`` in ``work``; returns its run id, wall time and loads."""
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    load_before, start = _load(), time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "torchshell.app.cli", "train", f"seed={seed}", *extra]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return {
        "uri": f"sqlite:///{work / 'mlflow.db'}",
        "run_id": runs[0].info.run_id,
        "wall_s": wall,
        "cpu_s": cpu,  # the whole command, workers included: / 2 cores = its time unloaded
        "load_before": load_before,
        "load_after": _load(),
    }


def run_figures(uri: str, run_id: str) -> dict[str, Any]:
    """Test accuracy, test/examples, samples/s, steps/s and the time of fit of a run."""
    import mlflow

    run = mlflow.MlflowClient(uri).get_run(run_id)
    m, p = run.data.metrics, run.data.params
    batch = float(p.get("data.batch_size", 64))
    steps = float(p.get("trainer.max_steps", 600))
    samples_s = m.get("system/coreshell.perf.samples_per_s", m.get("samples/s", float("nan")))
    return {
        "test_accuracy": m.get("test/accuracy"),
        "test_examples": m.get("test/examples"),
        "samples_s": samples_s,
        "steps_s": samples_s / batch,
        "fit_s": steps * batch / samples_s,
        "steps": steps,
    }


def twin_predict(safetensors: str, config: str | None = None) -> Any:
    """``predict({"waveform", "lengths"})`` of the torch twin with exported weights behind
    its serving front end (what the MLflow model runs), for a run without an MLflow model."""
    import torch
    import yaml
    from safetensors.torch import load_file

    from torchshell.twins.spoken_digits import SpokenDigitsEncoder

    flax = yaml.safe_load(Path(config).read_text())["model"]["flax"] if config else {}
    keys = ("width", "depth", "heads", "mlp_ratio", "num_classes")
    twin = SpokenDigitsEncoder(**{k: flax[k] for k in keys if k in flax}).eval()
    twin.load_state_dict(load_file(safetensors), strict=True)
    serving = twin.serving()

    def predict(request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits = serving(
                torch.from_numpy(request["waveform"]), torch.from_numpy(request["lengths"])
            )
        return {"label": logits.argmax(-1).numpy()}

    return predict


def score_test_split(predict: Any, batch: int = 32) -> tuple[int, int]:
    """``(correct, clips)`` of the default set's test split (unseen voices) through ``predict``."""
    from torchshell.data.spoken_digits import SpokenDigitsDataset, ensure_spoken_digits

    test = SpokenDigitsDataset(ensure_spoken_digits(), "test")
    correct = 0
    for start in range(0, len(test), batch):
        rows = range(start, min(start + batch, len(test)))
        waves = [test.wave(i).numpy() for i in rows]
        lengths = np.array([w.size for w in waves], np.int64)
        padded = np.zeros((len(waves), lengths.max()), np.float32)
        for r, w in enumerate(waves):
            padded[r, : w.size] = w
        labels = predict({"waveform": padded, "lengths": lengths})["label"]
        correct += sum(
            int(lab == test.clips[i]["label"]) for lab, i in zip(labels, rows, strict=True)
        )
    return correct, len(test)


def score_heldout(uri: str, run_id: str, batch: int = 32) -> dict[str, tuple[int, int]]:
    """``{condition: (correct, clips)}`` of the held-out set through the run's MLflow model
    (``uri`` ``twin:WEIGHTS.safetensors[:config.yaml]``: the torch twin with those weights)."""
    import soundfile as sf

    from torchshell.data._spoken_digits_heldout import ensure_heldout

    folder = ensure_heldout()
    clips = json.loads((folder / "manifest.json").read_text())["clips"]
    if uri.startswith("twin:"):
        predict = twin_predict(*uri[5:].split(":"))
    else:
        import mlflow

        mlflow.set_tracking_uri(uri)
        predict = mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for start in range(0, len(clips), batch):
        rows = clips[start : start + batch]
        waves = [sf.read(folder / c["path"], dtype="float32")[0] for c in rows]
        lengths = np.array([w.size for w in waves], np.int64)
        padded = np.zeros((len(waves), lengths.max()), np.float32)
        for r, w in enumerate(waves):
            padded[r, : w.size] = w
        labels = predict({"waveform": padded, "lengths": lengths})["label"]
        for clip, label in zip(rows, labels, strict=True):
            tally[clip["condition"]][0] += int(label == clip["label"])
            tally[clip["condition"]][1] += 1
    return {k: (v[0], v[1]) for k, v in tally.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("bench-results/speech_accuracy"))
    parser.add_argument("--score", nargs="*", default=[], help="DB_PATH:RUN_ID (no training)")
    parser.add_argument(
        "--twin", nargs="*", default=[], help="WEIGHTS.safetensors[:config.yaml]: held-out only"
    )
    parser.add_argument("overrides", nargs="*", help="extra coreshell train overrides")
    args = parser.parse_args()
    runs = []
    for item in args.score:
        db, run_id = item.rsplit(":", 1)
        runs.append({"seed": "?", "uri": f"sqlite:///{Path(db).resolve()}", "run_id": run_id})
    for item in args.twin:
        right, clips = score_test_split(twin_predict(*item.split(":")))
        print(f"{item}: test split {right / clips:.4f} ({clips} clips)", flush=True)
        held = score_heldout(f"twin:{item}", "")
        correct, total = (sum(v[i] for v in held.values()) for i in (0, 1))
        per = ", ".join(f"{k} {c / n:.3f}" for k, (c, n) in sorted(held.items()))
        print(f"{item}: held-out {correct / total:.4f} ({total} clips): {per}", flush=True)
    if args.twin:
        return
    if not args.score:
        for seed in args.seeds:
            info = train(seed, args.work.resolve() / f"seed{seed}", args.overrides)
            runs.append({"seed": seed, **info})
            print(
                f"seed {seed}: {info['wall_s']:.0f} s wall, {info['cpu_s']:.0f} CPU-s "
                f"(whole command, workers included), load {info['load_before']:.1f}",
                flush=True,
            )
    header = (
        "| seed | test acc | test clips | steps/s | fit s | load | held-out acc | per condition |"
    )
    print(header + "\n" + "|---" * (header.count("|") - 1) + "|")
    for run in runs:
        fig = run_figures(run["uri"], run["run_id"])
        held = score_heldout(run["uri"], run["run_id"])
        correct, total = (sum(v[i] for v in held.values()) for i in (0, 1))
        per = ", ".join(f"{k} {c / n:.3f}" for k, (c, n) in sorted(held.items()))
        load = (
            f"{run.get('load_before', float('nan')):.1f}-{run.get('load_after', float('nan')):.1f}"
        )
        print(
            f"| {run['seed']} | {fig['test_accuracy']:.4f} | {fig['test_examples']:.0f} | "
            f"{fig['steps_s']:.2f} | {fig['fit_s']:.0f} | {load} | {correct / total:.4f} "
            f"({total}) | {per} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
