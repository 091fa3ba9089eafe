#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and no network (the H200 machines: torch 2.11,
# Python 3.12, transformers 5.x already installed). Installs NOTHING: the working tree's sources
# go on PYTHONPATH, and a generated dist-info registers the torch_dynamo_backends entry point so
# that backend="npugraph_ex" resolves as it does after `pip install`.
#
#   OUT=/some/dir scripts/gpu_check.sh        (or: nox -s gpu)
#
# Runs `pytest -m cuda`, the demo on cuda, and the GPU benchmarks, and writes into $OUT (default
# ./gpu-results) at most 8 files: run.log (environment and every step's output), cuda-tests.log,
# demo.json, demo.png, decode/bench.json and decode/bench.png (section c, the ~1B-parameter
# decode step per compiler), rest/bench.json and rest/bench.png (sections a, g, e, b, f, s).
# Finishes within 10 minutes: every step has its own time limit (560 s in all; a step that fails
# or runs out of time is noted and the next one runs; the benches write bench.json as they go).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT" || exit 1
LOG="$OUT/run.log"
: > "$LOG"

SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
BACKEND_VERSION="$(sed -n 's/^__version__ *= *"\(.*\)"/\1/p' packages/npugraph-backend/src/npugraph_backend/__about__.py)"
DIST="$SITE/npugraph_backend-${BACKEND_VERSION:-0.0.0}.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: npugraph-backend\nVersion: %s\n' "${BACKEND_VERSION:-0.0.0}" > "$DIST/METADATA"
printf '[torch_dynamo_backends]\nnpugraph_ex = npugraph_backend.backend:npugraph_ex_backend\n' > "$DIST/entry_points.txt"

SRC="$ROOT/src"
for pkg in "$ROOT"/packages/*/src; do SRC="$SRC:$pkg"; done
export PYTHONPATH="$SITE:$SRC${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

status=0
step() {  # step NAME SECONDS LOGFILE CMD...: run with a time limit, remember failures
    local name="$1" limit="$2" log="$3"; shift 3
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    local rc=$?
    [ "$log" = "$LOG" ] || tail -n 15 "$log" >> "$LOG"
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

step "environment" 20 "$LOG" "$PY" - <<'PYEOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as exc:
    print("transformers missing:", exc)
import npugraph_ex
print("npugraph_ex", npugraph_ex.__version__, "registered:", "npugraph_ex" in torch.compiler.list_backends())
PYEOF
step "pytest -m cuda" 120 "$OUT/cuda-tests.log" "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra"
step "demo (cuda)" 45 "$LOG" "$PY" -m npugraph_ex.cli demo --device cuda --out "$OUT" --no-progress
step "bench (c) decode, cuda" 240 "$LOG" "$PY" -m npugraph_ex.cli bench --device cuda --only c --out "$OUT/decode" --no-progress --inductor-budget 60 --budget 170
step "bench (a,g,e,b,f,s), cuda" 135 "$LOG" "$PY" -m npugraph_ex.cli bench --device cuda --only a,g,e,b,f,s --out "$OUT/rest" --no-progress --budget 100
echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo 'a step failed'); results in $OUT" | tee -a "$LOG"
exit $status
