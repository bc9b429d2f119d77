#!/usr/bin/env bash
# GPU readiness in one run (< 8 min on one H200), one table at the end:
#   1. the CUDA DLPack hand-over test (tests/bridge/test_transfer.py -k cuda; skipped on CPU),
#   2. bf16 MFU of a Whisper-base-sized encoder (d=512, 6 layers, 1,500 frames) against a pure
#      Flax reference step, and JaxModule.from_torch on the same encoder in torch
#      (gpu_encoder.py),
#   3. the peers on GPU: the user's-DataLoader headline (user_path.py) and the recipes'
#      table (train_peers.py, digits MLP and spoken-digits encoder).
# Each stage runs under its own time limit; one that fails or runs out is a FAILED row (its
# log's tail printed under the table) and the others still run: a GPU lease is short.
# Needs `pip install -e '.[cuda12]'` (jax[cuda12], pinned like jax in pyproject.toml).
#
#   benchmarks/gpu.sh             # on the GPU machine
#   benchmarks/gpu.sh --dry-run   # CPU, tiny sizes (run by the suite): the DLPack test, the
#                                 # encoder rows and the table; the peers' scripts are left to
#                                 # tests/test_benchmarks.py (their --tiny runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch and JAX share the GPU
export PYTHONUNBUFFERED=1

if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  ENC_ARGS=(--dry-run)
else
  ENC_ARGS=(--steps 20 --batch 16)
fi
"$PY" - <<'PY'
import jax
print("JAX", jax.__version__, "devices:", jax.devices(), flush=True)
PY

# stage NAME SECONDS CMD...: CMD's output in $WORK/NAME.txt and on stderr as it runs (so a
# machine given back mid-run leaves the log), its exit status in $WORK/NAME.rc
stage() {
  local name=$1 limit=$2 rc=0
  shift 2
  timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.txt" >&2 || rc=$?
  echo "$rc" > "$WORK/$name.rc"
  echo "[$SECONDS s] $name: exit $rc" >&2
}

# 1. DLPack hand-over of CUDA tensors (passes on a GPU, is skipped on CPU)
stage dlpack 90 "$PY" -m pytest -q -rs -p no:cacheprovider tests/bridge/test_transfer.py -k cuda
# (the dry run's limit is a loaded 2-core CPU's: its 2 tiny steps took over 200 s at load 8)
stage encoder "$([[ $DRY == 1 ]] && echo 300 || echo 200)" "$PY" benchmarks/gpu_encoder.py \
  "${ENC_ARGS[@]}" --json "$WORK/encoder.json"
if [[ $DRY == 1 ]]; then  # (tests/test_benchmarks.py runs train_peers.py --tiny already)
  # one loader form: the script's path, not the forms (test_benchmarks runs all three)
  stage user 240 "$PY" benchmarks/user_path.py --tiny --only a,e --forms "dict collate" \
    --json "$WORK/user.json"
else
  stage user 120 "$PY" benchmarks/user_path.py --rounds 3 --steps 400 --json "$WORK/user.json"
  stage peers 200 "$PY" benchmarks/train_peers.py --rounds 3 --json "$WORK/peers.json"
fi

WORK="$WORK" "$PY" - <<'PY'
import importlib.util, json, os, re
from pathlib import Path

spec = importlib.util.spec_from_file_location("_stats", "benchmarks/_stats.py")
stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stats)
work = Path(os.environ["WORK"])
text = (work / "dlpack.txt").read_text()
passed = re.search(r"(\d+) passed", text)
skipped = re.search(r"(\d+) skipped", text)
rc = int((work / "dlpack.rc").read_text())
verdict = (
    f"{passed.group(1)} passed" if passed and rc == 0
    else f"skipped ({skipped.group(1)}: no CUDA device)" if skipped and rc in (0, 5)
    else f"FAILED (exit {rc})"
)
rows = [stats.row("gpu: CUDA DLPack hand-over", "tests/bridge/test_transfer.py -k cuda",
                  "result", [1.0 if passed and rc == 0 else 0.0], note=verdict)]
failed = ["dlpack"] if "FAILED" in verdict else []
for name in ("encoder", "user", "peers"):
    if not (work / f"{name}.rc").exists():
        continue  # not run in this mode
    rc = int((work / f"{name}.rc").read_text())
    if rc == 0:
        rows += json.loads((work / f"{name}.json").read_text())["rows"]
    else:
        failed.append(name)
        why = "ran out of time" if rc == 124 else f"exit {rc}"
        rows.append(stats.row(f"gpu: {name} stage", "see its log below", "result", [0.0],
                              note=f"FAILED ({why})"))
la = stats.load_average()
print(f"load average {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}")
print(stats.markdown(rows))
for name in failed:
    print(f"\n--- {name}: the end of its log ---\n" + (work / f"{name}.txt").read_text()[-3000:])
raise SystemExit(1 if failed else 0)
PY
