#!/usr/bin/env bash
# The GPU suite: one command on a GPU host that runs the CUDA tests and every GPU comparison and prints the
# tables, in under 6 minutes (each step has its own time limit, so one slow step cannot eat the others').
#
#   bash bench/device_suite.sh            # from the repo root, on a machine with a CUDA device
#
# Uses the python3 on the PATH (PYTHON=... to choose another) with torch, safetensors and pytest installed;
# trainstate runs from ./src. Wheels for anything missing (a machine with no network) may be put in .whl/:
# they are installed into /tmp/site first. Logs and tables go to $OUT (default /tmp/device-suite).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/device-suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its output, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s; $((SECONDS - start)) s elapsed)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name FAILED (exit $rc)"; status=1; }
}

step machine 30 "$PY" -c "
import os, torch, trainstate
from trainstate import _cores
print('cores usable', _cores.usable_cores(), '| default threads', _cores.DEFAULT_THREADS)
print('torch', torch.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())
"
step cuda-tests 80 "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu tests/test_ring.py tests/with_jax/test_jax_accelerator_paths.py
step restore 140 "$PY" bench/bench_restore.py --only gpu,cpu,open --rounds 3
step gpu-training-state 55 "$PY" bench/bench_gpu.py --repeats 3
step jax 50 "$PY" bench/bench_jax.py --quick --rounds 2
echo "== done in $((SECONDS - start)) s; logs in $OUT"
exit $status
