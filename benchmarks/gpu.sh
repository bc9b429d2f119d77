#!/usr/bin/env bash
# GPU readiness in one run (< 8 min on one H200), one table at the end:
#   1. the CUDA DLPack hand-over test (tests/bridge/test_transfer.py -k cuda; skipped on CPU),
#   2. the peers on GPU: the user's-DataLoader headline (user_path.py) and the recipes'
#      table (train_peers.py, digits MLP and spoken-digits encoder),
#   3. bf16 MFU of a Whisper-base-sized encoder (d=512, 6 layers, 1,500 frames) against a pure
#      Flax reference step, and JaxModule.from_torch on the same encoder in torch
#      (gpu_encoder.py).
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
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch and JAX share the GPU

if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  USER_ARGS=(--tiny --only a,e)
  ENC_ARGS=(--dry-run)
else
  USER_ARGS=(--rounds 3 --steps 400)
  ENC_ARGS=(--steps 20 --batch 16)
fi
"$PY" - <<'PY'
import jax
print("JAX devices:", jax.devices(), flush=True)
PY

# 1. DLPack hand-over of CUDA tensors (passes on a GPU, is skipped on CPU)
set +e
"$PY" -m pytest -q -rs -p no:cacheprovider tests/bridge/test_transfer.py -k cuda \
  > "$OUT/dlpack.txt" 2>&1
DLPACK_RC=$?
set -e
echo "[$SECONDS s] DLPack test: exit $DLPACK_RC" >&2
"$PY" benchmarks/user_path.py "${USER_ARGS[@]}" --json "$OUT/user.json" > "$OUT/user.txt"
if [[ $DRY == 1 ]]; then  # (tests/test_benchmarks.py runs train_peers.py --tiny already)
  echo '{"rows": []}' > "$OUT/peers.json"
else
  "$PY" benchmarks/train_peers.py --rounds 3 --json "$OUT/peers.json" > "$OUT/peers.txt"
fi
echo "[$SECONDS s] peers done" >&2
"$PY" benchmarks/gpu_encoder.py "${ENC_ARGS[@]}" --json "$OUT/encoder.json" > "$OUT/enc.txt"

echo "[$SECONDS s] encoder done" >&2
DLPACK_RC=$DLPACK_RC OUT="$OUT" "$PY" - <<'PY'
import importlib.util, json, os, re
from pathlib import Path

spec = importlib.util.spec_from_file_location("_stats", "benchmarks/_stats.py")
stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stats)
out = Path(os.environ["OUT"])
text = (out / "dlpack.txt").read_text()
passed = re.search(r"(\d+) passed", text)
skipped = re.search(r"(\d+) skipped", text)
rc = int(os.environ["DLPACK_RC"])
verdict = (
    f"{passed.group(1)} passed" if passed and rc == 0
    else f"skipped ({skipped.group(1)}: no CUDA device)" if skipped and rc in (0, 5)
    else f"FAILED (exit {rc})"
)
rows = [stats.row("gpu: CUDA DLPack hand-over", "tests/bridge/test_transfer.py -k cuda",
                  "result", [1.0 if passed and rc == 0 else 0.0], note=verdict)]
for name in ("user.json", "peers.json", "encoder.json"):
    rows += json.loads((out / name).read_text())["rows"]
la = stats.load_average()
print(f"load average {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}")
print(stats.markdown(rows))
if "FAILED" in verdict:
    print((out / "dlpack.txt").read_text()[-3000:])
    raise SystemExit(1)
PY
