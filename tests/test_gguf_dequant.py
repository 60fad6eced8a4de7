"""Dequantisation of each GGUF tensor type: round trips through gguf's quantiser where it has one, blocks
packed by hand from the format description for the K-quants, and gguf's own decoder as a cross-check."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_model_support import one_torch_thread

from radixserve.configs.model_config import ModelLoadError
from radixserve.model_loader.gguf_dequant import dequantize, supported_type_names

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

Q = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)


def _ours(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return dequantize(raw, qtype, shape, "t").numpy()


@pytest.mark.parametrize("qtype, tol", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.15), (Q.Q4_1, 0.1)])
def test_round_trip_through_gguf_quantize(qtype, tol):
    x = RNG.standard_normal((8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    ours = _ours(raw, qtype, x.shape)
    # the quantisation error is bounded by the block step, relative to each block's range
    assert np.abs(ours - x).max() < tol * np.abs(x).max()
    assert np.array_equal(ours, gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_float_types(qtype):
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    raw = x if qtype == Q.F32 else gguf.quants.quantize(x, qtype)
    expected = x if qtype == Q.F32 else torch.from_numpy(x).to(
        torch.float16 if qtype == Q.F16 else torch.bfloat16).float().numpy()
    assert np.array_equal(_ours(raw, qtype, x.shape), expected)


def _f16_bytes(values) -> np.ndarray:
    return np.frombuffer(np.asarray(values, dtype=np.float16).tobytes(), dtype=np.uint8)


def _pack_q4_k(d: float, dmin: float, scales: np.ndarray, mins: np.ndarray, q: np.ndarray) -> np.ndarray:
    """One Q4_K super-block: scales/mins 8 x 6 bits, q 8 sub-blocks x 32 values of 4 bits."""
    packed = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6)
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6)
        packed[j + 8] = (scales[j + 4] & 0x0F) | ((mins[j + 4] & 0x0F) << 4)
    qs = np.zeros(128, dtype=np.uint8)
    for chunk in range(4):
        qs[32 * chunk : 32 * chunk + 32] = q[2 * chunk] | (q[2 * chunk + 1] << 4)
    return np.concatenate([_f16_bytes([d, dmin]), packed, qs])


def test_q4_k_hand_packed_blocks():
    blocks, expected = [], []
    for _ in range(6):
        d, dmin = np.float16(RNG.uniform(0.01, 0.1)), np.float16(RNG.uniform(0.0, 0.05))
        scales, mins = RNG.integers(0, 64, 8, dtype=np.uint8), RNG.integers(0, 64, 8, dtype=np.uint8)
        q = RNG.integers(0, 16, (8, 32), dtype=np.uint8)
        blocks.append(_pack_q4_k(d, dmin, scales, mins, q))
        values = float(d) * scales[:, None].astype(np.float32) * q - float(dmin) * mins[:, None].astype(np.float32)
        expected.append(values.reshape(-1))
    raw = np.stack(blocks).reshape(2, -1)
    ours = _ours(raw, Q.Q4_K, (2, 768))
    assert np.allclose(ours, np.concatenate(expected).reshape(2, 768), rtol=1e-6, atol=1e-6)
    assert np.array_equal(ours, gguf.quants.dequantize(raw, Q.Q4_K))


def _pack_q6_k(d: float, scales: np.ndarray, q: np.ndarray) -> np.ndarray:
    """One Q6_K super-block: q 256 values of 6 bits (0..63), 16 int8 scales."""
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for half in range(2):
        for lane in range(32):
            q1, q2, q3, q4 = (int(q[128 * half + 32 * g + lane]) for g in range(4))
            ql[64 * half + lane] = (q1 & 0x0F) | ((q3 & 0x0F) << 4)
            ql[64 * half + 32 + lane] = (q2 & 0x0F) | ((q4 & 0x0F) << 4)
            qh[32 * half + lane] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), _f16_bytes([d])])


def test_q6_k_hand_packed_blocks():
    blocks, expected = [], []
    for _ in range(4):
        d = np.float16(RNG.uniform(0.001, 0.01))
        scales = RNG.integers(-128, 128, 16).astype(np.int8)
        q = RNG.integers(0, 64, 256, dtype=np.uint8)
        blocks.append(_pack_q6_k(d, scales, q))
        element = np.arange(256)
        scale_of = 8 * (element // 128) + 2 * ((element % 128) // 32) + (element % 32) // 16
        expected.append(float(d) * scales[scale_of].astype(np.float32) * (q.astype(np.float32) - 32))
    raw = np.stack(blocks)
    ours = _ours(raw, Q.Q6_K, (4, 256))
    assert np.allclose(ours, np.stack(expected), rtol=1e-6, atol=1e-6)
    assert np.array_equal(ours, gguf.quants.dequantize(raw, Q.Q6_K))


def test_other_types_go_through_gguf():
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.Q5_0)
    assert np.array_equal(_ours(raw, Q.Q5_0, x.shape), gguf.quants.dequantize(raw, Q.Q5_0))
    assert {"Q5_0", "Q5_K", "Q4_K", "Q6_K"} <= set(supported_type_names())


def test_wrong_byte_count_is_an_error():
    raw = gguf.quants.quantize(RNG.standard_normal((1, 64)).astype(np.float32), Q.Q8_0)[:, :-3]
    with pytest.raises(ModelLoadError, match="not a whole number of Q8_0 blocks"):
        dequantize(raw, Q.Q8_0, (1, 64), "t")


def test_integer_types_are_refused():
    with pytest.raises(ModelLoadError, match="I8, which radixserve does not dequantize"):
        dequantize(np.zeros(8, dtype=np.int8), Q.I8, (8,), "t")
