#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU: the tests marked `cuda` (tests/test_cuda.py and the
# CUDA-stream tests of the overlap loop) and a short decode timing against transformers (benchmarks/bench_gpu.py).
#
#   bash scripts/cuda_check.sh            # in a checkout whose environment has radixserve's dependencies
#
# Optional: WHEELS=<folder of wheels> installs them first (a machine with no package index); TOKENIZER=<folder
# with SmolLM2's config.json and tokenizer files> where the embedded model is not installed; OUT=<folder> for the
# logs; TESTS=<pytest ids> runs only those (WORKERS=0: in one process, so that a crash prints its stack). Each part
# has its own time limit, so the script ends and reports even when one hangs.
set -o pipefail
OUT=${OUT:-/tmp/radixserve_cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/site"
fi
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  torch.cuda.get_device_name())" || exit 1
extra=()
if [ -n "$TOKENIZER" ]; then
  export RADIXSERVE_TEST_TOKENIZER="$TOKENIZER"
  # a random model with SmolLM2's tokenizer for the test that runs on the default model. NOTE: weights drawn wide
  # (initializer_range 0.2) so that greedy argmaxes are clear: near-flat logits would let GEMM algorithm choices
  # between two batch shapes flip ties, which says nothing about the scheduler
  python3 - "$TOKENIZER" "$OUT/smollm2-random" <<'PY' || exit 1
import json, shutil, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
source, out = Path(sys.argv[1]), Path(sys.argv[2])
special = json.loads((source / "config.json").read_text())
torch.manual_seed(0)
config = LlamaConfig(vocab_size=special["vocab_size"], hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, initializer_range=0.2,
                     tie_word_embeddings=True, eos_token_id=special["eos_token_id"], bos_token_id=special["bos_token_id"])
AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(source / name, out / name)
PY
  export RADIXSERVE_TEST_CUDA_MODEL="$OUT/smollm2-random"
  extra=(--tokenizer "$TOKENIZER")
fi
# NOTE: a limit per test (pytest-timeout, which dumps every thread's stack when it fires) and -v, so that a hang
# names itself; SIGINT at the overall limit, so that pytest still prints its summary
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PER_TEST_LIMIT:-150}" --timeout-method thread)
timeout -s INT "${TEST_LIMIT:-300}" python3 -m pytest -v -rfEs --tb=short -m cuda -p no:cacheprovider -p no:benchmark \
  -n "${WORKERS:-4}" "${per_test[@]}" --junitxml="$OUT/cuda_tests.xml" ${TESTS:-tests/test_cuda.py tests/test_lifecycle.py \
  tests/test_overlap_parity.py tests/test_overlap_utils.py} 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
rm -rf "$OUT/smollm2-random"
for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-1.5b}; do
  timeout "${BENCH_LIMIT:-110}" python3 benchmarks/bench_gpu.py --shape "$shape" "${extra[@]}" 2>&1 \
    | grep -v "Writing model shards" | tee -a "$OUT/bench_gpu.log"
done
echo "tests exit code: $tests_rc"
exit $tests_rc
