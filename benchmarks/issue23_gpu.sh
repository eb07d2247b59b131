#!/usr/bin/env bash
# Issue 23's GPU rows in one device call (the device tool runs it in the repository root, with the
# wheels of .whl carried: refit's pure-Python dependencies and SGLang 0.5.23 with what its
# serializer imports, see docs/benchmarks.md): the IPC reopen measurement, optional GPU tests, then
# `refit bench gpu` per shape (each shape's JSON and log apart, so one that runs out of time keeps
# the others). Settings by environment:
#   SHAPES  shapes, one bench call each (default "7b 1.5b"; 14b: the trainer's 29.5 GB and the
#           engine's, about 62 GB at the peak, so an 80 GB card holds it)
#   PATHS   the bench's --paths (default floor,flattened,sglang,ipc,sglang_resident,sglang_resident_one)
#   REFITS  timed refits per path (default 5); TESTS  pytest arguments for tests_gpu (default none)
#   LORA_TOKENS  the lora path's tokens per request (default 128; fewer: shorter drains, more refits)
set -uo pipefail
OUT=${OUT:-/tmp/refit-gpu}
mkdir -p "$OUT"
for w in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1 || true
done
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1 REFIT_PROGRESS=lines  # progress lines in the logs
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'
} > "$OUT/env.txt" 2>&1
rc=0
if [ "${REOPEN:-1}" = 1 ]; then
    timeout 120 python3 benchmarks/ipc_reopen.py "$OUT/ipc_reopen.json" > "$OUT/ipc_reopen.log" 2>&1 || rc=1
fi
if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider $TESTS > "$OUT/tests_gpu.log" 2>&1 || rc=1
    # the verdict on stdout too (a log that does not come back still leaves its last lines in the reply)
    tail -n 15 "$OUT/tests_gpu.log" | cut -c1-300
fi
for shape in ${SHAPES:-7b 1.5b}; do
    timeout "${BENCH_TIMEOUT:-300}" python3 -m refit.cli bench gpu --shapes "$shape" \
        --paths "${PATHS:-floor,flattened,sglang,ipc,sglang_resident,sglang_resident_one}" --refits "${REFITS:-5}" \
        --lora-tokens "${LORA_TOKENS:-128}" --json "$OUT/bench_$shape.json" > "$OUT/bench_$shape.log" 2>&1 || rc=1
done
exit $rc
