#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU and no network (the H200 machines: torch 2.11,
# Python 3.12, transformers 5.x already installed). Installs NOTHING: the working tree's sources
# go on PYTHONPATH, and a generated dist-info registers the torch_dynamo_backends entry point so
# that backend="npugraph_ex" resolves as it does after `pip install`.
#
#   OUT=/some/dir scripts/gpu_check.sh        (or: nox -s gpu)
#
# Runs `pytest -m cuda`, the demo on cuda, and the GPU benchmark; writes to $OUT (default
# ./gpu-results): env.txt, cuda-tests.log, demo.json, demo.png, bench.json, bench.png, bench.log.
# Finishes within 10 minutes: each step has its own time limit, and the benchmark a --budget.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT" || exit 1

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
step() {  # step NAME SECONDS LOG CMD...: run with a time limit, log to $OUT/LOG, remember failures
    local name="$1" limit="$2" log="$3"; shift 3
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$log"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}

"$PY" - > "$OUT/env.txt" 2>&1 <<'PYEOF'
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
import npugraph_ex, npugraph_runtime, npugraph_backend
print("npugraph_ex", npugraph_ex.__version__, "backends:", "npugraph_ex" in torch.compiler.list_backends())
PYEOF
cat "$OUT/env.txt"

step "pytest -m cuda" 120 cuda-tests.log "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra"
step "demo (cuda)" 60 demo.log "$PY" -m npugraph_ex.cli demo --device cuda --out "$OUT" --no-progress
step "bench (cuda)" 360 bench.log "$PY" -m npugraph_ex.cli bench --device cuda --out "$OUT" --no-progress --budget 300 --inductor-budget 60 --only a,g,e,b,c,f
rm -f "$OUT/demo.log"  # its output is in demo.json; $OUT returns at most 8 files
echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo 'a step failed') — results in $OUT"
exit $status
