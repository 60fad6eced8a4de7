#!/usr/bin/env bash
# The GPU checks of the Triton attention backend and CUDA graphs (docs/attention.md#what-is-left-for-a-gpu), for a
# machine with an NVIDIA GPU, torch and triton installed and no network; about 8 minutes on an H100:
#   1. the Triton kernel tests, compiled on the GPU this time, against float64 (tests/test_triton_attention.py) and
#      the graph runner's padding and refill (tests/test_cuda_graph_runner.py);
#   2. the `cuda` tests: graphs on = graphs off (both loops, pages 1/16, float32/bf16, Gemma 3's hybrid pool),
#      triton = torch backend, verify steps eager (tests/test_cuda_graphs.py), then Engines against transformers;
#   3. benchmarks/bench_gpu_graphs.py: greedy identity of graphs on vs off (both loops), then decode tokens/s at
#      batch 1/8/32/128 with graphs on and off beside the memory-bandwidth bound.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# Optional: OUT=<folder> for the logs; BATCHES=1,8,32,128; SHAPE=qwen2.5-0.5b; SWEEP=1 adds the kernels' long sweep.
# Each part has its own time limit, so the script ends and reports even when one hangs; the exit code is non-zero
# when any part failed.
set -o pipefail
OUT=${OUT:-/tmp/radixserve_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # NOTE: compiled kernels here; the CPU runs the same tests in the interpreter
start=$(date +%s)
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  torch.cuda.get_device_name())" || exit 1
failed=()
part() {  # part NAME LIMIT_S COMMAND...: runs it under its limit, logged to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $(( $(date +%s) - start ))s)"
  timeout -s INT "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
}
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n "${WORKERS:-4}")
pytest_args=(-q -rfEs --tb=short -p no:cacheprovider)
part kernels 100 python3 -m pytest "${pytest_args[@]}" tests/test_triton_attention.py tests/test_cuda_graph_runner.py
part cuda_tests 220 python3 -m pytest "${pytest_args[@]}" -m cuda "${xdist[@]}" tests/test_cuda_graphs.py \
  tests/test_cuda.py tests/test_overlap_utils.py
part bench 160 python3 benchmarks/bench_gpu_graphs.py --batches "${BATCHES:-1,8,32,128}" \
  --shape "${SHAPE:-qwen2.5-0.5b}"
[ "${SWEEP:-0}" = 1 ] && part sweep 120 python3 -m pytest "${pytest_args[@]}" -m long tests/test_triton_attention.py
echo "== done in $(( $(date +%s) - start ))s; logs in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all parts passed"
