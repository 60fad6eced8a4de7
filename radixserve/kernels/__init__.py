"""radixserve's native code: the C sources of every kernel family (csrc/), their one builder (build.py), and a
thin ctypes binding per family, which loads what `build.py` built and says nothing of when to use it:

- attention.py: paged decode, causal extend and shared-prefix attention, one library holding every ISA level
  (and `SELECTED`, the measured table the attention plan reads);
- attention_amx.py: bf16 extend attention on AMX tiles;
- gemv.py: the bf16 GEMV (AVX512-BF16) and AMX products over a tile-interleaved weight;
- quant.py: packed int8/int4 products and expansion, one library per ISA level;
- quant_tiled.py: the tiled packed layout's product, expansion and row lookup (AVX-512 VNNI);
- c_decoder.py: the one-call C decoder's model struct and functions.

The levels and their flags are platform.py's. Where each kernel runs is decided by the execution plan and the
layers that call them (model_executor/execution_plan.py, layers/).
"""
