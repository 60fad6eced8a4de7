"""Packed int8 / int4 weights: the formats, the C kernels of every ISA level this CPU runs, GGUF tensors
of each supported type loaded into packed layers, and tiny models quantized at load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_gguf_support import Q, write_gguf
from test_model_support import make_tiny_model, one_torch_thread, rel_err

from radixserve.configs.model_config import ModelLoadError
from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.quant import load_quant_kernel, runnable_isas
from radixserve.layers.quantization.formats import QK, quantize_int4, quantize_int8
from radixserve.layers.quantization.linear import packed_linear
from radixserve.model_loader.gguf_loader import open_gguf
from radixserve.models.gguf_packed import nearest_spec, to_packed
from radixserve.models.loader import load_model

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

# Relative (Frobenius) error of a product against x @ dequantized(W)^T: the int8 activations add ~0.5%.
PRODUCT_TOL = {"int8 per-channel": 1.5e-2, "int8 g32": 1.5e-2, "int4 g32": 1.5e-2}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _formats(n: int = 72, k: int = 256, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, [quantize_int8(w, per_channel=True), quantize_int8(w, per_channel=False), quantize_int4(w)]


def _fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _emulated(packed, x: torch.Tensor) -> torch.Tensor:
    """The kernel's own arithmetic in float64 torch: activations rounded to int8 per block of 32."""
    m, k = x.shape
    blocks = x.double().view(m, k // QK, QK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks)).clamp(-127, 127)
    return (q * d).view(m, k) @ packed.dequantize(torch.float64).T


def test_quantizers_stay_within_half_a_step():
    w, (per_channel, per_block, int4) = _formats()
    for packed in (per_channel, per_block):
        step = packed.scales.float().repeat_interleave(w.shape[1] // packed.scales.shape[1], dim=1)
        assert ((packed.dequantize() - w).abs() <= step / 2 * 1.01 + 1e-7).all()
        assert packed.qweight.abs().max() <= 127
    step = int4.scales.float().repeat_interleave(QK, dim=1)
    assert ((int4.dequantize() - w).abs() <= step / 2 * 1.01 + 1e-4).all()
    assert per_channel.nbytes == 72 * 256 + 72 * 2 and int4.nbytes == 72 * 128 + 2 * 72 * 8 * 2


@pytest.mark.parametrize("isa", runnable_isas())
def test_kernel_products_match_the_dequantized_reference(isa):
    kernel = load_quant_kernel(isa)
    assert kernel is not None and kernel.compiled_isa == isa
    _, packs = _formats()
    for packed in packs:
        reference = packed.dequantize()
        for m in (1, 3, 4, 7):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
                y = kernel.matmul(packed, x, dtype)
                assert y.dtype == dtype and y.shape == (m, 72)
                assert _fro(y, x.float() @ reference.T) < PRODUCT_TOL[packed.format_name], (packed.format_name, m)
                if dtype == torch.float32:  # the same arithmetic exactly, but for float32 summation order
                    assert _fro(y, _emulated(packed, x)) < 2e-6, (packed.format_name, m)
        for dtype in (torch.float32, torch.bfloat16):
            out = kernel.dequant(packed, 8, 40, torch.empty(32, 256, dtype=dtype))
            assert torch.equal(out, reference[8:40].to(dtype))


def test_every_level_computes_the_same_products():
    _, packs = _formats(n=40, k=96)  # K = 3 blocks: an odd block count exercises the tails
    x = torch.randn(5, 96)
    for packed in packs:
        results = [load_quant_kernel(isa).matmul(packed, x, torch.float32) for isa in runnable_isas()]
        for y in results[1:]:
            assert _fro(y, results[0]) < 1e-6


def test_packed_linear_paths_small_and_large_batches():
    _, packs = _formats(n=64, k=128)
    for packed in packs:
        reference = packed.dequantize()
        for m in (1, DEFAULT_ROWS.packed_rows, DEFAULT_ROWS.packed_rows + 1, 300):
            x = torch.randn(m, 128)
            expected = x @ reference.T
            assert _fro(packed_linear(packed, x, load_quant_kernel()), expected) < 1.5e-2
            assert _fro(packed_linear(packed, x, None), expected) < 1e-6  # the portable torch path
        if m > DEFAULT_ROWS.packed_rows:  # the expanded-weight path multiplies with float weights: no activation rounding
            assert _fro(packed_linear(packed, torch.ones(300, 128), load_quant_kernel()),
                        torch.ones(300, 128) @ reference.T) < 1e-6


def test_kernel_rejects_shapes_it_does_not_take():
    packed = quantize_int4(torch.randn(8, 64))
    packed.scales = packed.scales[:, :1].contiguous()  # int4 needs a scale per block
    with pytest.raises(ValueError, match="rejected"):
        load_quant_kernel().matmul(packed, torch.randn(1, 64), torch.float32)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 48))


# ---- GGUF tensor types -> packed formats ----

BLOCK_TEMPLATE = {  # (bytes per block, byte ranges holding float16 scales to make finite and small)
    "Q8_0": ((0, 2),), "Q4_0": ((0, 2),), "Q4_1": ((0, 2), (2, 4)), "Q4_K": ((0, 2), (2, 4)),
    "Q5_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),),
}
EXACT = {"Q8_0": 0.0, "Q4_0": 0.0, "Q4_1": 0.0, "Q4_K": 2e-3}  # Q4_K: sub-block scale products in float16


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    qtype = Q[kind]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    if kind == "Q8_0":
        raw[raw == 0x80] = 0x81  # -128: a Q8_0 quantizer never writes it, and the int8 format clamps it
    for lo, hi in BLOCK_TEMPLATE[kind]:
        scales = rng.uniform(0.002, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., lo:hi] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", list(BLOCK_TEMPLATE))
def test_gguf_tensor_types_load_into_their_nearest_format(kind, tmp_path):
    n, k = 16, 512
    raw = _random_blocks(kind, n, k, np.random.default_rng(3))
    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = open_gguf(path).tensors[0]
    reference = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(n, k).astype(np.float32))
    spec = nearest_spec(kind)
    packed = to_packed(tensor.data, tensor.tensor_type, (n, k), spec, tensor.name)
    assert packed.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    got = packed.dequantize()
    if kind in EXACT:
        assert rel_err(got, reference) <= EXACT[kind]
    else:  # Q5_K / Q6_K: requantized to int8 per block of 32, within half a step
        step = packed.scales.float().repeat_interleave(QK, dim=1)
        assert ((got - reference).abs() <= step / 2 * 1.01 + 1e-6).all()


def test_gguf_tensor_with_a_k_not_divisible_by_32_is_refused():
    with pytest.raises(ModelLoadError, match="cannot be packed"):
        to_packed(np.zeros(4 * 48, dtype=np.float32), Q.F32, (4, 48), nearest_spec("Q8_0"), "x")


# ---- whole (tiny) models ----

def _logits(loaded, prompt: list[int]) -> torch.Tensor:
    from direct_driver import DirectDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(dtype="float32", max_total_tokens=256), loaded=loaded)
    driver = DirectDriver(runner)
    req = driver.new_request()
    last = [driver.extend([req], [prompt])[0]]
    for token in (5, 9):  # two decode steps (one row: the kernel path)
        last.append(driver.decode([req], [token])[0])
    driver.release_all()
    return torch.stack(last)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_model(folder, "llama", seed=11)
    quants = {"mlp.": Q.Q8_0, "self_attn.q_proj": Q.Q4_1, "self_attn.k_proj": Q.Q4_0, "self_attn.v_proj": Q.Q4_1,
              "self_attn.o_proj": Q.Q4_0, "embed_tokens": Q.Q8_0}
    write_gguf(folder / "tiny.gguf", hf, "llama", quants)
    return folder


def test_gguf_model_served_packed_matches_the_dequantized_model(tiny_llama):
    path = str(tiny_llama / "tiny.gguf")
    prompt = list(range(3, 60, 3))
    reference = _logits(load_model(path, torch.float32, "cpu"), prompt)
    packed = load_model(path, torch.float32, "cpu", "int4")
    layer = packed.model.model.layers[0]
    assert layer.self_attn.qkv_proj.method.packed.format_name == "int4 g32"  # Q4_1 + Q4_0 + Q4_1: all 4-bit
    assert layer.self_attn.o_proj.method.packed.format_name == "int4 g32"
    assert layer.mlp.gate_up_proj.method.packed.format_name == "int8 g32"  # Q8_0 stays 8-bit whatever was asked
    assert packed.model.lm_head.method.packed.format_name == "int8 g32"  # float in the file: the LM head policy
    # the float model of the same file, with packed weights dequantized exactly: only activation rounding
    qkv = layer.self_attn.qkv_proj.method.packed.dequantize()
    assert torch.equal(qkv, load_model(path, torch.float32, "cpu").model.model.layers[0].self_attn.qkv_proj.weight)
    assert rel_err(_logits(packed, prompt), reference) < 3e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_hf_folder_quantized_at_load(tiny_llama, method):
    """Against the float model carrying the packed weights dequantized: what is left is the kernels' own error
    (a random tiny model amplifies weight rounding itself far beyond a trained one's; see docs/quantization.md)."""
    prompt = list(range(10, 50, 2))
    loaded = load_model(str(tiny_llama), torch.float32, "cpu", method)
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.method.name == "packed" and m.weight is None for m in linears)
    expected = "int8 per-channel" if method == "int8" else "int4 g32"
    assert loaded.model.model.layers[1].mlp.down_proj.method.packed.format_name == expected
    assert loaded.model.model.embed_tokens.packed.format_name == "int8 g32"
    reference = load_model(str(tiny_llama), torch.float32, "cpu")
    float_modules = dict(reference.model.named_modules())
    for name, module in loaded.model.named_modules():
        packed = getattr(getattr(module, "method", module), "packed", None)
        if packed is not None:
            float_modules[name].weight.data.copy_(packed.dequantize())
    # NOTE: where the tiled layout runs (AVX-512 VNNI), the 20-token prefill rounds its activations to int8
    # too (the tiled kernel takes up to 32 rows), not only the decode steps: measured 3.1% here for int4.
    assert rel_err(_logits(loaded, prompt), _logits(reference, prompt)) < 4e-2


def test_quantization_is_refused_on_cuda_with_a_clear_error():
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="no cuda path"):
        ModelRunner(ServerArgs(device="cuda", quantization="int4"))
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model(None, torch.bfloat16, "cuda", "int8")
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int3")


def test_levels_are_the_ones_this_cpu_has_not_every_one_below_the_best(monkeypatch):
    """An AMD Zen 4 has AVX512-VNNI but not AVX-VNNI (the VEX form): avx_vnni is not one of its levels (running
    it there was an illegal instruction)."""
    from radixserve.kernels import quant

    zen4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                      "avx512_bf16"})
    monkeypatch.setattr(quant, "cpu_flags", lambda: zen4)
    monkeypatch.setattr(quant, "is_x86", lambda: True)
    assert quant.best_quant_isa() == "avx512_vnni"
    assert quant.runnable_isas() == ["avx512_vnni", "avx2", "portable"]
    monkeypatch.setattr(quant, "cpu_flags", lambda: zen4 | {"avx_vnni"})
    assert quant.runnable_isas() == ["avx512_vnni", "avx_vnni", "avx2", "portable"]
