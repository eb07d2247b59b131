#!/usr/bin/env bash
# The GPU run, one command on the lent H200 machine (the device tool runs it in the repository
# root): refit's small pure-Python dependencies from carried wheels (.whl, see docs/benchmarks.md),
# the GPU checks (tests_gpu/; the two-GPU file only where two GPUs are visible), then
# `refit bench gpu` (and `refit bench broadcast` on two GPUs). Logs and the JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/refit-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 REFIT_PROGRESS=lines  # progress lines in the logs
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'; } > "$OUT/env.txt" 2>&1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
files=(tests_gpu/test_wsum.py tests_gpu/test_cuda_refit.py tests_gpu/test_sglang_receiver.py tests_gpu/test_sglang_tile_hash_gpu.py)
[ "$gpus" -ge 2 ] && files+=(tests_gpu/test_two_gpu.py)
rc=0
timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -x "${files[@]}" "$@" 2>&1 | tee "$OUT/tests_gpu.log" || rc=1
# BENCHES: which benches to run (default: gpu; and broadcast where two GPUs are visible)
benches=${BENCHES:-gpu$([ "$gpus" -ge 2 ] && echo " broadcast")}
for b in $benches; do
    timeout "${GPU_BENCH_TIMEOUT:-420}" python3 -m refit.cli bench "$b" --json "$OUT/bench_$b.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.log" || rc=1
done
exit $rc
