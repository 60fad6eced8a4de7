"""radixserve's native code: the C sources of every kernel family (csrc/) and their one builder (build.py).

The Python bindings of each family load what `build.py` built: attention (layers/attention/native.py,
amx_extend.py), bf16 GEMV and AMX GEMM (layers/gemv.py), packed int8/int4 (layers/quantization/kernels.py,
tiled.py) and the C decode step (models/decode_step.py). The levels and their flags are platform.py's.
"""
