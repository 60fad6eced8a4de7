"""The Triton attention kernels compiled for an H100 (sm_90) on the CPU, with the ptxas that ships in triton's wheel:
what the interpreter cannot show (tl.dot shapes and dtypes, loop-carried types, shared memory per program), short of
running them. In a subprocess, because this test run's other Triton tests decorate the kernels for the interpreter.

Under `long` (a few seconds per kernel variant)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

H100_SHARED_BYTES = 232448  # 227 KiB of shared memory per block on sm_90
# (query dtype, kv dtype, GQA group, head dim, soft-cap, window, translated slots): the models' combinations
VARIANTS = [("fp32", "fp32", 1, 64, False, False, False), ("fp32", "bf16", 4, 128, False, True, True),
            ("bf16", "bf16", 7, 64, True, True, False), ("bf16", "bf16", 2, 256, True, True, True),
            ("fp16", "fp16", 8, 128, False, False, False), ("fp32", "fp32", 2, 256, True, False, False)]


def compile_variants() -> list[dict]:
    """Compiles each variant's decode stage 1, stage 2 and extend kernel for sm_90; their shared memory."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve.layers.attention.triton_ops.decode_attention import (
        _decode_stage1,
        _decode_stage2,
        products,
        stages,
    )
    from radixserve.layers.attention.triton_ops.extend_attention import _extend_kernel

    pointers = {"Table": "i32", "Translate": "i32", "SeqLens": "i64", "PrefixLens": "i64", "ExtendLens": "i64",
                "QStarts": "i64", "MidO": "fp32", "MidLse": "fp32"}
    out = []
    for q, kv, group, dim, cap, window, translate in VARIANTS:
        block_d = triton.next_power_of_2(dim)
        torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[q]
        flags = {"HAS_CAP": cap, "HAS_WINDOW": window, "HAS_TRANSLATE": translate,
                 **products(getattr(torch, torch_dtype))}
        kernels = [
            (_decode_stage1, {"GROUP": group, "BLOCK_H": max(16, triton.next_power_of_2(group)), "HEAD_DIM": dim,
                              "BLOCK_D": block_d, "BLOCK_N": 32, **flags}),
            (_decode_stage2, {"HEAD_DIM": dim, "BLOCK_D": block_d, "BLOCK_S": 8}),
            (_extend_kernel, {"GROUP": group, "HEAD_DIM": dim, "BLOCK_D": block_d, "BLOCK_M": 32, "BLOCK_N": 32,
                              **flags}),
        ]
        for fn, consts in kernels:
            signature = {name: _kind(name, consts, q, kv, pointers) for name in fn.arg_names}
            source = ASTSource(fn, signature, constexprs=consts)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_stages": stages(block_d)})
            out.append({"kernel": fn.__name__, "variant": [q, kv, group, dim, cap, window, translate],
                        "shared": compiled.metadata.shared})
    return out


def _kind(name: str, consts: dict, q: str, kv: str, pointers: dict[str, str]) -> str:
    """A kernel argument's type in Triton's signature strings."""
    if name in consts:
        return "constexpr"
    if name in ("K", "V"):
        return f"*{kv}"
    if name in ("Q", "KNew", "VNew", "Out"):
        return f"*{q}"
    if name in pointers:
        return f"*{pointers[name]}"
    return "fp32" if name in ("scaling", "cap") else "i32"


@pytest.mark.long
def test_kernels_compile_for_sm90_within_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * len(VARIANTS)
    over = [r for r in results if r["shared"] > H100_SHARED_BYTES]
    assert not over, over


if __name__ == "__main__":
    print(json.dumps(compile_variants()))
