#!/usr/bin/env bash
# TPU readiness (one TPU v5e chip): every stage under its own limit and all of them inside one
# budget (TPU_SH_BUDGET=520 s after the install), one table at the end.
# A stage that fails or runs out of time is a FAILED row (its log's tail printed under the
# table) and the others still run; each stage's output (its rows) shows as it runs.
#   1. encoder: a Whisper-base-sized encoder (d=512 x6, 1,500 frames, B=16, bf16) four ways: a
#      pure Flax step, JaxModule, from_torch, from_lightning (gpu_encoder.py --ways r,a,t,l);
#   2. models: ViT-B/16 and GPT-2 small, each a team's LightningModule through
#      JaxModule.from_lightning beside a pure-Flax twin of the same shapes and optimizer:
#      steps/s, MFU, the ratio (tpu_models.py --models vit,gpt; its Whisper-base classifier
#      runs alone: stage 1 has the encoder);
#   3. speech: the default speech recipe through `coreshell train data.front_end=device`
#      (tpu_speech.py: MLflow to SQLite, Orbax checkpoints, export and its parity);
#   4. transfer: a torch batch onto the chip, bridge.to_jax against bare jax.device_put
#      (tpu_transfer.py);
#   5. digits: the digits MLP at the defaults on the user's DataLoader against the hand-written
#      Lightning+JAX hybrid and Keras 3 (user_path.py; the host-bound case).
#
# The stack on the TPU machine (no registry there): its own JAX 0.10.2 + libtpu; torch 2.13 CPU
# from /opt/wheels; flax, optax, orbax-checkpoint, keras, scikit-learn... from its own index
# (file:///opt/pypi/simple); the rest carried as wheels in .whl-tpu/, fetched here with
#   benchmarks/tpu.sh --fetch-wheels      (torchax, lightning, lightning-utilities,
#                                          torchmetrics, torchdata, hydra-core, omegaconf, an
#                                          antlr4 wheel built from its sdist; the speech
#                                          recipe's torchaudio, espeakng-loader, MLflow, soundfile; 33 MB)
# and the device call names .whl-tpu in `carry` (docs/tpu.md). Everything installs under
# /tmp/site (TPU_SITE), after the machine's JAX on PYTHONPATH.
#
#   benchmarks/tpu.sh [STAGES]             # on the TPU machine; STAGES: a comma list of
#                                          # models,encoder,transfer,digits,speech (all)
#   benchmarks/tpu.sh --dry-run [STAGES]   # CPU, tiny sizes (run by the suite): the table
# Every stage on the chip takes ~15 min, past one device call's 10: the lent machine runs it as
# two calls, `tpu.sh models` and `tpu.sh encoder,transfer,digits,speech` (docs/tpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-}"
# the wheels the TPU machine's index lacks (.whl-tpu/, 33 MB): pure Python ones, then the
# speech recipe's host stack: torchaudio 2.11.1 (the newest build; it runs beside torch 2.13),
# eSpeak NG's loader (libespeak-ng and its voices), MLflow's client (mlflow-skinny) with the
# two of its needs the index lacks, and `mlflow` itself (installed without its server's needs);
# soundfile's manylinux wheel (libsndfile inside: the index's py2.py3-none-any one wants the
# system's libsndfile.so, which that machine lacks: the recipe's data module failed to import)
CARRIED=(torchax==0.0.13 lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0
         torchdata==0.11.0 hydra-core==1.3.8 omegaconf==2.3.1 torchaudio==2.11.1
         espeakng-loader==0.2.4 mlflow-skinny==3.17.2 databricks-sdk==0.156.0
         opentelemetry-semantic-conventions==0.66b0 soundfile==0.14.0)
MLFLOW=mlflow==3.17.2
if [[ $MODE == --fetch-wheels ]]; then  # here, where a registry is reachable
  mkdir -p .whl-tpu
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --platform any --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-tpu \
    "${CARRIED[@]}" "$MLFLOW" &&
    python3 -m pip wheel -q --no-deps -w .whl-tpu antlr4-python3-runtime==4.9.3 &&
    du -sh .whl-tpu
  exit
fi
DRY=0
if [[ $MODE == --dry-run ]]; then DRY=1; shift; fi
ALL=models,encoder,transfer,digits,speech
STAGES=",${1:-$ALL},"
for s in ${STAGES//,/ }; do
  if [[ ",$ALL," != *",$s,"* ]]; then echo "unknown stage '$s': expected a comma list of $ALL" >&2; exit 2; fi
done
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1

if [[ $DRY == 1 ]]; then
  PY="${PY:-.venv/bin/python}"
  BUDGET=100000
  export JAX_PLATFORMS=cpu
  # XLA's CPU backend unoptimised: tiny steps compile twice as fast; their figures mean nothing
  export XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  # one loader form in the dry run: the script's path (test_benchmarks runs every form)
  ENC=(--dry-run) MODELS=(--dry-run) TRANSFER=(--dry-run) DIGITS=(--tiny --rounds 1)
  FORMS="dict collate"
  SPEECH=(--dry-run)
else
  PY="${PY:-python3}"
  SITE="${TPU_SITE:-/tmp/site}"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
  if ! "$PY" -c "import torch, flax, lightning, torchax, torchaudio, mlflow" 2>/dev/null; then
    echo "installing into $SITE (torch 2.13 CPU, the index's packages, .whl-tpu)" >&2
    export PIP_CONFIG_FILE=/dev/null
    if ! compgen -G ".whl-tpu/*.whl" >/dev/null; then
      echo "no .whl-tpu: run benchmarks/tpu.sh --fetch-wheels here" >&2
      exit 2
    fi
    # one resolver run over the index, /opt/wheels and .whl-tpu (one --target install, so the
    # namespace packages that several wheels fill, opentelemetry, google, come out whole;
    # pandas: mlflow.models.signature imports it; flatbuffers: jax.export serializes with it),
    # then `mlflow` itself without its server's needs over mlflow-skinny: the same files and
    # more, and the distribution that the model's `mlflow==` requirement records
    "$PY" -m pip install --isolated -q --no-compile --only-binary=:all: --upgrade \
      --index-url file:///opt/pypi/simple --find-links /opt/wheels --find-links .whl-tpu \
      --target "$SITE" torch flax optax orbax-checkpoint safetensors pyyaml tqdm fsspec rich \
      packaging typing-extensions prometheus-client scikit-learn keras soundfile matplotlib \
      pandas flatbuffers sqlalchemy alembic "${CARRIED[@]}" 2>&1 |
      grep -v -e "^WARNING: Location" -e "notice" >&2
    "$PY" -m pip install --isolated -q --no-index --no-deps --no-compile --upgrade \
      --target "$SITE" ".whl-tpu/${MLFLOW/==/-}-"*.whl 2>&1 | grep -v -e notice -e "WARNING: Target" >&2
    # the registry's torchaudio 2.11.1 is a CUDA build: its C++ extension links libtorch_cuda,
    # which torch 2.13+cpu lacks. torchaudio imports without it where its .so files are absent,
    # and what the recipe takes (resample, spectrogram, the mel scale) is torch code: the same
    # bits as torchaudio 2.9.1 under torch 2.9.1 (tested here). Gone with it: the RNN-T loss,
    # forced alignment and the CTC decoder's kernels.
    rm -f "$SITE"/torchaudio/lib/*.so
  fi
  BUDGET="${TPU_SH_BUDGET:-520}"  # (the install before it took 70 s)
  ENC=(--steps 20 --batch 16) MODELS=() TRANSFER=() DIGITS=(--rounds 2 --steps 300) SPEECH=()
  # the 2-core CPU's run of the recipe, when one was measured and carried (docs/tpu.md)
  REF=bench-results/speech_cpu.json
  if [[ -f $REF ]]; then SPEECH=(--reference "$REF"); fi
  FORMS="dict collate,TensorDataset tuples"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
"$PY" -c "import jax, torch; print('JAX', jax.__version__, jax.devices(), 'torch', torch.__version__)"

# stage NAME SECONDS CMD...: CMD's output in $WORK/NAME.txt and on stderr as it runs, its exit
# status in $WORK/NAME.rc; the limit is cut to what is left of $BUDGET (under 20 s: not run)
stage() {
  local name=$1 limit=$2 rc=0 left=$((BUDGET - SECONDS + START))
  shift 2
  if [[ $STAGES != *",$name,"* ]]; then return; fi
  if ((left < limit)); then limit=$left; fi
  if ((limit < 20)); then
    echo "not run: ${left} s left of tpu.sh's ${BUDGET} s budget" | tee "$WORK/$name.txt" >&2
    echo budget > "$WORK/$name.rc"
    return
  fi
  timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.txt" >&2 || rc=$?
  echo "$rc" > "$WORK/$name.rc"
  echo "[$((SECONDS - START)) s] $name: exit $rc" >&2
}

# (the dry run's limits are a loaded 2-core CPU's: in the suite beside the other worker its
# tiny models took 18-38 s to their first step each, the whole run ~600 s)
lim() { if [[ $DRY == 1 ]]; then echo "$2"; else echo "$1"; fi; }
stage models "$(lim 450 900)" "$PY" benchmarks/tpu_models.py --models vit,gpt "${MODELS[@]}" \
  --json "$WORK/models.json"
stage encoder "$(lim 270 600)" "$PY" benchmarks/gpu_encoder.py --ways r,a,t,l "${ENC[@]}" \
  --json "$WORK/encoder.json"
stage transfer "$(lim 60 300)" "$PY" benchmarks/tpu_transfer.py "${TRANSFER[@]}" \
  --json "$WORK/transfer.json"
stage digits "$(lim 150 600)" "$PY" benchmarks/user_path.py "${DIGITS[@]}" --only a,c,e \
  --forms "$FORMS" --json "$WORK/digits.json"
stage speech "$(lim 60 900)" "$PY" benchmarks/tpu_speech.py "${SPEECH[@]}" \
  --json "$WORK/speech.json"

WORK="$WORK" "$PY" - <<'PY'
import importlib.util, json, os
from pathlib import Path

spec = importlib.util.spec_from_file_location("_stats", "benchmarks/_stats.py")
stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stats)
work = Path(os.environ["WORK"])
rows, failed = [], []
for name in ["encoder", "models", "speech", "transfer", "digits"]:
    if not (work / f"{name}.rc").exists():  # (a stage not asked for)
        continue
    rc = (work / f"{name}.rc").read_text().strip()
    done = work / f"{name}.json"
    if done.exists():  # (a stage cut short keeps the rows it wrote)
        rows += json.loads(done.read_text())["rows"]
    if rc != "0":
        failed.append(name)
        why = {"124": "ran out of time", "budget": "not run: the time budget was spent"}
        rows.append(stats.row(f"tpu: {name} stage", "see its log below", "result", [0.0],
                              note=f"FAILED ({why.get(rc, f'exit {rc}')})"))
la = stats.load_average()
print(f"load average {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}")
print(stats.markdown(rows))
for name in failed:
    print(f"\n--- {name}: the end of its log ---\n" + (work / f"{name}.txt").read_text()[-2500:])
raise SystemExit(1 if failed else 0)
PY
