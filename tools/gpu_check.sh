#!/usr/bin/env bash
# Every GPU test and benchmark of kvrt, then a short table (tools/gpu_summary.py). Run from
# the repository root on a host with two GPUs; on one GPU, `all` and `bench` run the tests,
# `kernels`, the one-GPU `ipc` and `nixl` (both processes on cuda:0), the benchmarks that fit it:
#   bash tools/gpu_check.sh [all|tests|bench|nccl|kernels|pull|stream|ipc|nixl|vllm]
#   bash tools/gpu_check.sh ab BENCH [ROUNDS]
# Results and logs go to $OUT (/tmp/kvrt-gpu by default). `tests` honours PYTEST_K (a -k
# expression) and PYTEST_ARGS. Wheels found in .whl/ are installed first, into /tmp/site (for
# a host without a package index); kvrt itself is installed editable from the working tree.
# `ab` compares the working tree with a baseline in the same call (machines of one kind differ
# by several points, so only runs of one call compare): make the baseline first with
#   mkdir _ab && git archive REV | tar -x -C _ab        (_ab/ is ignored by git)
# then `ab` runs `kvrt bench BENCH` with each side in turns, ROUNDS times (2 by default).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvrt-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/gpus.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())' | tee "$OUT/versions.txt"

only=${1:-all}
if [ "$only" = all ] || [ "$only" = tests ]; then
  # PYTEST_K="ipc and stream" selects tests by a -k expression (it may hold spaces); PYTEST_ARGS
  # adds words of its own (split on spaces: no quoting inside).
  timeout 480 python3 -m pytest -v -m "gpu or kernels" -p no:cacheprovider tests/ ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} -rs --tb=short -o timeout_method=thread --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
fi
if [ "$only" = ab ]; then
  bench=${2:-nccl}
  rounds=${3:-2}
  [ -d _ab ] || { echo "ab: no _ab/ here (see the header of this script)"; exit 1; }
  # Both sides installed apart, run from /tmp: the editable install's import hook would hand
  # the working tree's kvrt to the old side's child processes (the benchmarks spawn them).
  python3 -m pip uninstall -y -q kvrt > "$OUT/ab-install.log" 2>&1
  for side in new old; do
    source=. && [ "$side" = old ] && source=./_ab
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "/tmp/kvrt-$side" "$source" \
      >> "$OUT/ab-install.log" 2>&1 || { tail -5 "$OUT/ab-install.log"; exit 1; }
  done
  for round in $(seq "$rounds"); do
    for side in new old; do
      log="$OUT/ab-$bench-$side-$round.log"
      (cd /tmp && PYTHONPATH="/tmp/kvrt-$side:${PYTHONPATH:-}" timeout 240 python3 -m kvrt bench "$bench" > "$log" 2>&1)
      (cd /tmp && PYTHONPATH="/tmp/kvrt-$side:${PYTHONPATH:-}" python3 -c 'import kvrt; print(kvrt.__file__)') | sed "s/^/$side: kvrt from /"
      grep -E "MiB \||raw NCCL send|p50|vs reference|kvrt," "$log" | sed "s/^/$side $round: /" || tail -5 "$log"
    done
  done
  exit 0
fi
if [ "$only" = pull ]; then
  timeout 240 python3 -m kvrt bench pull --json "$OUT/pull.json" 2>&1 | tail -12
  exit 0
fi
if [ "$only" = stream ]; then
  timeout 200 python3 -m kvrt bench stream --json "$OUT/stream.json" 2>&1 | tail -12
  exit 0
fi
if [ "$only" = ipc ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
  timeout 300 python3 -m kvrt bench ipc --json "$OUT/ipc-one-gpu.json" 2>&1 | tee "$OUT/bench-ipc.log" | tail -30
  exit 0
fi
if [ "$only" = ipc ]; then
  timeout 300 python3 -m kvrt bench ipc --json "$OUT/ipc.json" 2>&1 | tee "$OUT/bench-ipc.log" | tail -30
  timeout 200 python3 -m kvrt bench stream --transport cuda_ipc --json "$OUT/stream-ipc.json" 2>&1 | tee "$OUT/bench-stream-ipc.log" | tail -12
  exit 0
fi
if [ "$only" = nixl ]; then
  timeout 330 python3 -m kvrt bench nixl --json "$OUT/nixl.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/bench-nixl.log" | tail -12
  exit 0
fi
if [ "$only" = vllm ]; then
  timeout 300 python3 -m kvrt bench vllm --json "$OUT/vllm.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/bench-vllm.log" | tail -12
  exit 0
fi
if [ "$only" = kernels ]; then
  timeout 300 python3 -m kvrt bench kernels --json "$OUT/kernels.json" 2>&1 | tail -25
  exit 0
fi
if [ "$only" = nccl ]; then
  timeout 240 python3 -m kvrt bench nccl --json "$OUT/nccl.json" 2>&1 | tail -12
  exit 0
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if { [ "$only" = all ] || [ "$only" = bench ]; } && [ "$gpus" -lt 2 ]; then
  timeout 120 python3 -m kvrt bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench-kernels.log"
  timeout 300 python3 -m kvrt bench ipc --json "$OUT/ipc-one-gpu.json" 2>&1 | tee "$OUT/bench-ipc.log"
  timeout 330 python3 -m kvrt bench nixl --json "$OUT/nixl.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/bench-nixl.log"
  timeout 300 python3 -m kvrt bench vllm --json "$OUT/vllm.json" 2>&1 | tee "$OUT/bench-vllm.log"
elif [ "$only" = all ] || [ "$only" = bench ]; then
  timeout 200 python3 -m kvrt bench nccl --json "$OUT/nccl.json" 2>&1 | tee "$OUT/bench-nccl.log"
  timeout 120 python3 -m kvrt bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench-kernels.log"
  timeout 200 python3 -m kvrt bench pull --json "$OUT/pull.json" 2>&1 | tee "$OUT/bench-pull.log"
  timeout 200 python3 -m kvrt bench stream --json "$OUT/stream.json" 2>&1 | tee "$OUT/bench-stream.log"
  timeout 300 python3 -m kvrt bench ipc --json "$OUT/ipc.json" 2>&1 | tee "$OUT/bench-ipc.log"
  timeout 200 python3 -m kvrt bench stream --transport cuda_ipc --json "$OUT/stream-ipc.json" 2>&1 | tee "$OUT/bench-stream-ipc.log"
fi
python3 tools/gpu_summary.py "$OUT"
