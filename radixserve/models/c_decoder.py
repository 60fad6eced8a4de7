"""A decode batch's decoder layers in one C call (kernels/csrc/decode_loop.h), in two builds:

- bf16 (csrc/decode_step.c) on CPUs with AVX512-BF16: every decoder linear layer on the GEMV/AMX method
  (`onednn_gemv`) or on tiled int4/int8 weights (`packed`); bit-equal to the Python layers. Prefill batches of
  such a model use the step's SiLU-and-mul and add + RMSNorm loops too (prefill_passes.py).
- float32 (csrc/decode_step_f32.c) on AVX2 + FMA and AVX-512: every decoder linear layer on bf16 weights
  (`bf16_weights`, what `--dtype auto` picks on CPUs without bf16 products), on float32 weights (`f32_gemv`,
  `--dtype float32`) or on tiled int4/int8 weights;
  equal to the Python layers to float32 rounding (their passes are inductor's, with its own exp and summation
  order).

The layers' linear products and decode attention are the kernels the Python path calls too; what the C
loop removes is ~10 Python-level calls per layer, each of which costs 25-40 us after the weight stream
has evicted its code (docs/cpu_fast_path.md). It takes a decode forward when the model has plain rotary
(no q/k norms), the backend's C decode kernel, and no more rows than the linear kernel takes; a cascade batch
(a prefix the batch shares) too where part (a) runs in a C function (the AMX prefix kernel in bf16, the C prefix
kernel under float32 over a bf16 cache), which the step calls before the seeded decode kernel, as the Python
layers do. Anything else runs the layers in Python. Sliding-window layers (Mistral, Qwen2/3) read their
window's attention group (`_groups`). A batch with LoRA rows runs in the step too: after each linear layer it adds
the adapters' deltas with the SGMV kernel the Python layers call (c_decoder_lora.py). Switch:
RADIXSERVE_DECODE_STEP=0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve import envs
from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.kernels.build import is_x86
from radixserve.kernels.c_decoder import (
    STYLES,
    CDecoderKernel,
    GroupTable,
    ModelStruct,
    attention_groups,
    load_c_decoder_kernel,
)
from radixserve.kernels.gemv import load_gemv_kernel
from radixserve.layers.attention.torch_metadata import TorchAttnMetadata, metadata_of
from radixserve.layers.attention.window import WindowDecodeMetadata
from radixserve.layers.bf16_weights import Bf16WeightLinearMethod
from radixserve.layers.f32_gemv import F32GemvLinearMethod
from radixserve.layers.gemv import GemvLinearMethod
from radixserve.layers.quantization.linear import PackedLinearMethod
from radixserve.models.c_decoder_lora import CDecoderLora

if TYPE_CHECKING:
    from ctypes import Array as ctypes_array

    from radixserve.models.causal_lm import DecoderWeights

logger = logging.getLogger(__name__)
ROWS_UNBOUNDED = 1 << 30  # deterministic inference: the step takes a forward of any number of rows

class StepFunctions(NamedTuple):
    attention: int | None  # the decode attention kernel's C function
    prefix: int | None  # cascade's part (a): the prefix kernel's C function


class CDecoder:
    """`__call__(hidden, fb)` runs every decoder layer of a decode forward; `takes(fb)` says whether it can.

    It reads the model through its exported weight view (`LlamaForCausalLM.decoder_weights`) and the KV pool
    through `get_kv_buffer`: the layer table of pointers it hands to C is built from those two, nothing else."""

    def __init__(self, weights: DecoderWeights, kernel: CDecoderKernel, every_forward: bool = False,
                 rows: RowTable = DEFAULT_ROWS) -> None:
        config, self._weights, self._kernel = weights.config, weights, kernel
        self._config, self.dtype = config, kernel.dtype
        linears = [linear for layer in weights.layers for linear in layer.linears]
        self._fns = [linear.method.c_linear(1, self.dtype) for linear in linears]
        # NOTE: the table holds one C function per linear layer, the one `apply` runs at 1 row; the step takes
        # the batch sizes at which every layer still runs that same function (the Python layers' choice too).
        # None anywhere (a weight the plan could not foresee, an int8 table left in the row layout): no sizes.
        # `rows`: the plan's table, the one device_setup gave every linear method
        self.max_rows = max((n for n in rows.linear_row_limits()
                             if all(fn is not None and linear.method.c_linear(n, self.dtype) == fn
                                    for linear, fn in zip(linears, self._fns, strict=True))), default=0)
        # NOTE: deterministic inference: every forward's tokens run here as rows (a prompt's token i attends over
        # its request's first i + 1 slots), on linear methods that take every row count with their row kernel
        self.every_forward = every_forward and self.max_rows > 0 and all(
            linear.method.c_linear(ROWS_UNBOUNDED, self.dtype) == fn for linear, fn in zip(linears, self._fns, strict=True))
        if self.every_forward:
            self.max_rows = ROWS_UNBOUNDED
        if self.max_rows == 0:
            logger.warning("the C decoder finds a linear layer without a C kernel here; decode runs the Python layers")
        # NOTE: each layer's row names its rotary tables: the window layers' own where the model has a local rotary
        rotaries = [weights.rotary if weights.local_rotary is None or config.window_of(i) is None
                    else weights.local_rotary for i in range(config.num_layers)]
        tables = {id(r): tuple(t.contiguous() for t in r.tables(torch.device("cpu"))) for r in rotaries}
        self._layer_tables = [tables[id(r)] for r in rotaries]
        max_position = min(cos.shape[0] for cos, _ in tables.values())
        # NOTE: attention group 0 is the full layers'; group 1 + i the layers of the model's i-th sliding window
        self._windows: tuple[int, ...] = config.windows
        self._group_of = [0 if config.window_of(i) is None else 1 + self._windows.index(config.window_of(i))
                          for i in range(config.num_layers)]
        self._struct = ModelStruct(config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                                   config.head_dim, config.intermediate_size, max_position, 1 + len(self._windows),
                                   STYLES[weights.style], 0, config.rms_norm_eps, weights.attention_scale, None)
        self._group_slots = [0] * (1 + len(self._windows))  # rows of each group's K/V buffers (_bind_pool)
        self._work_per_row = kernel.work_size(self._struct, 1)
        self._pool = None  # the KV pool whose buffers the layer table points at
        # (backend, KV cache dtype) -> the C functions the step calls: decode attention, cascade's part (a)
        self._functions: tuple[object, StepFunctions] = (None, StepFunctions(None, None))
        self._lora = CDecoderLora(weights, self.dtype)  # the forward's LoRA rows (the manager's segments)

    def takes(self, fb) -> bool:
        if fb.forward_mode.is_extend():
            return self._takes_rows(fb)
        backend = fb.attn_backend
        kv_dtype = fb.token_to_kv_pool.dtype
        # NOTE: the full layers' plain table, or their cascade plan where part (a) runs in a C function (the one the
        # Python layers call: the same results). A model with windows needs the backend's window tables (window.py),
        # not a window's cascade plan (window_cascade.py).
        fns = self._functions_for(backend, kv_dtype)
        meta = fb.attn_metadata
        if not isinstance(meta, TorchAttnMetadata):  # another backend's tables: the step reads only these
            return False
        plain = meta.decode is not None
        cascaded = not plain and meta.cascade_decode is not None and fns.prefix is not None
        return (fb.batch_size <= self.max_rows and (plain or cascaded)
                and all(isinstance(m, WindowDecodeMetadata) for m in meta.window_decode.values())
                and fns.attention is not None
                and self._lora.refusal() is None)

    def __call__(self, hidden: torch.Tensor, fb) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: the embeddings [bs, hidden] -> (last MLP output, residual stream), both [bs, hidden], as the
        Python layers' `run_layers` returns them; Gemma's layers add their last output into the stream themselves:
        (the whole stream, None)."""
        bs, backend = hidden.shape[0], fb.attn_backend
        fns = self._functions_for(backend, fb.token_to_kv_pool.dtype)
        rows = fb.forward_mode.is_extend()
        plain = rows or metadata_of(fb).decode is not None
        if fns.attention is None or bs > self.max_rows or not (plain or fns.prefix is not None) or (rows and not self.every_forward):
            raise ValueError("the C decoder does not take this forward (check `takes` first)")
        if fb.token_to_kv_pool is not self._pool:
            self._bind_pool(fb.token_to_kv_pool)
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        work = torch.empty(bs * self._work_per_row, dtype=self.dtype)
        positions = fb.positions.to(torch.int64).contiguous()
        groups, keep = self._row_groups(fb) if rows else self._groups(fb, fns.prefix)
        lora, keep_lora = self._lora.descriptor()
        status = self._kernel.run(self._struct, fns.attention, hidden, residual, positions, groups, work, lora)
        del keep, keep_lora  # NOTE: the group and LoRA tables' tensors live until the C call returns
        if status == 1:
            raise ValueError("C decoder: a position beyond the rotary table, a slot beyond the KV pool or a LoRA "
                             "row beyond the batch")
        if status != 0:
            raise RuntimeError(f"C decoder failed in layer {status // 1000 - 1}, call {status % 1000}")
        return (residual, None) if self._weights.style == "gemma" else (hidden, residual)

    def _takes_rows(self, fb) -> bool:
        """An extend forward as rows (deterministic inference): a model without windows, the C decode kernel, no
        LoRA rows."""
        return (self.every_forward and not self._windows and self._weights.style == "llama"
                and fb.req_to_token_pool is not None
                and fb.lora_adapters is None and isinstance(fb.attn_metadata, TorchAttnMetadata)
                and self._functions_for(fb.attn_backend, fb.token_to_kv_pool.dtype).attention is not None)

    def _row_groups(self, fb) -> tuple[ctypes_array, list[torch.Tensor]]:
        """An extend forward's one attention group, a row per token: the token at position p attends over its
        request's slots 0 .. p, read through the request's row of req_to_token (the decode tables' slots, in their
        order), so each row's attention is the one a decode step at that position computes."""
        lens = fb.extend_seq_lens.to(fb.req_pool_indices.device)
        owners = torch.repeat_interleave(fb.req_pool_indices, lens)
        max_len = max(fb.seq_lens_cpu)
        kv_indices = fb.req_to_token_pool.req_to_token[owners, :max_len]
        full = GroupTable(fb.out_cache_loc, kv_indices, fb.positions + 1, max_len, self._group_slots[0])
        return attention_groups([full])

    def _groups(self, fb, prefix: int | None) -> tuple[ctypes_array, list[torch.Tensor]]:
        """This step's attention groups: the full layers' (the backend's decode table, or its cascade plan: the
        shared prefix, read by the C function `prefix`, and each request's own positions), then each window's: its
        window table where the window hides keys or the pool is hybrid, else the full layers' own."""
        fmeta = metadata_of(fb)
        meta, cascaded = fmeta.decode, fmeta.cascade_decode
        if meta is not None:
            full = GroupTable(fb.out_cache_loc, meta.kv_indices, fb.seq_lens, meta.max_len, self._group_slots[0])
        else:
            full = GroupTable(fb.out_cache_loc, cascaded.suffix_indices, cascaded.suffix_lens,
                              cascaded.suffix_max_len, self._group_slots[0], cascaded.prefix_slots, prefix)
        window_loc = fmeta.window_out_loc  # hybrid pool: window layers write window slots
        tables = [full]
        for w, rows in zip(self._windows, self._group_slots[1:], strict=True):
            wmeta = fmeta.window_decode.get(w)
            tables.append(replace(full, num_slots=rows) if wmeta is None else
                          GroupTable(fb.out_cache_loc if window_loc is None else window_loc, wmeta.kv_indices,
                                     wmeta.lens, wmeta.max_len, rows))
        return attention_groups(tables)

    def _functions_for(self, backend, kv_dtype: torch.dtype) -> StepFunctions:
        """The C functions the backend's plan runs for the model's heads in this build's dtype over a `kv_dtype`
        cache: decode attention, and cascade's part (a) for a decode batch (the one the Python layers call); None
        where the backend has none (torch's op: the step does not take such a batch)."""
        if (backend, kv_dtype) != self._functions[0]:
            cfg = self._config
            q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=self.dtype)
            decode = (backend.decode_kernel_for(q, cfg.num_kv_heads, kv_dtype)
                      if hasattr(backend, "decode_kernel_for") else None)
            prefix = (backend.prefix_kernel_for(q, cfg.num_kv_heads, kv_dtype, decode=True)
                      if hasattr(backend, "prefix_kernel_for") else None)
            self._functions = ((backend, kv_dtype), StepFunctions(
                None if decode is None else decode.decode_address(self.dtype, kv_dtype),
                None if prefix is None else prefix.prefix_address(self.dtype, kv_dtype)))
        return self._functions[1]

    def _bind_pool(self, pool) -> None:
        if pool.dtype not in (self.dtype, torch.bfloat16):
            raise ValueError(f"the C decoder writes a {self.dtype} or bf16 KV cache, not {pool.dtype}")
        # NOTE: the f32 build rounds the new K/V to bf16 as it writes them (decode_loop.h's rotary_kv_row)
        self._struct.kv_bf16 = int(pool.dtype != self.dtype)
        rows, fns = [], iter(self._fns)
        slots: list[list[int]] = [[] for _ in self._group_slots]
        for i, layer in enumerate(self._weights.layers):
            k_cache, v_cache = pool.get_kv_buffer(i)
            group = self._group_of[i]
            slots[group] += [k_cache.shape[0], v_cache.shape[0]]
            bias = layer.qkv.bias
            qkv, o, gate_up, down = ([linear.method.c_weight.data_ptr(), next(fns)] for linear in layer.linears)
            cos, sin = self._layer_tables[i]
            gemma = (layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_ff_norm)
            # NOTE: decode_loop.h's order: IN_NORM, POST_NORM, QKV, QKV_FN, QKV_BIAS, O, O_FN, ... V_CACHE, GROUP,
            # COS, SIN, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FF_NORM
            rows.append([layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *qkv,
                         0 if bias is None else bias.data_ptr(), *o, *gate_up, *down,
                         k_cache.data_ptr(), v_cache.data_ptr(), group, cos.data_ptr(), sin.data_ptr(),
                         *(0 if t is None else t.data_ptr() for t in gemma)])
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._struct.layers = self._table.data_ptr()
        # a group no layer reads (every layer windowed): its slots are never written, any bound passes
        self._group_slots = [min(rows) if rows else 1 << 62 for rows in slots]
        self._pool = pool


def load_c_decoder(weights: DecoderWeights, dtype: torch.dtype, every_forward: bool = False,
                     rows: RowTable = DEFAULT_ROWS) -> CDecoder:
    """The C decoder over a model's weight view; only where `c_decoder_refusal` found no reason against it.
    `every_forward` (deterministic inference): extend forwards run in it too, a row per token."""
    return CDecoder(weights, load_c_decoder_kernel(dtype), every_forward, rows)


def c_decoder_refusal(weights: DecoderWeights | None, dtype: torch.dtype, ops: Any,
                        methods: Mapping[tuple[int, int], str], kv_dtype: torch.dtype | None = None) -> str | None:
    """Why decode batches of the model with this weight view (to run the fused ops `ops`, its float linear shapes
    planned on `methods`, over a `kv_dtype` cache, default `dtype`) run the decoder layers in Python rather than in
    one C call; None if C."""
    if not envs.DECODE_STEP.get():
        return f"{envs.DECODE_STEP.name}=0"
    if dtype not in LINEAR_OF_BUILD:
        return f"the C decoder is bfloat16 and float32 only (dtype {str(dtype).removeprefix('torch.')})"
    if kv_dtype not in (None, dtype, torch.bfloat16):
        return f"the C decoder writes a KV cache in the compute dtype or bf16, not {kv_dtype}"
    if not is_x86():
        return "the C decoder is x86 only"
    if weights is None:
        return "the model exports no decoder weight view the C step runs (Llama q/k norms, soft-capped attention)"
    # NOTE: the Llama loop rounds as the fused ops do; Gemma's layers run without them (eager torch)
    if weights.style == "llama" and (ops is None or ops.rotary_kv is None):
        return "the fused ops are off (the C loop is the fused path's layer structure)"
    if dtype == torch.bfloat16 and load_gemv_kernel() is None:
        return "no AVX512-BF16 GEMV at this kernel level"
    shape = _shape_refusal(weights, LINEAR_OF_BUILD[dtype], methods)
    if shape is not None:
        return shape
    if load_c_decoder_kernel(dtype) is None:
        return "the C decoder has no build for this kernel level" if dtype == torch.float32 else \
            "the C decoder did not build here"
    return None


# The float linear method whose C kernel each build calls; packed (int4/int8) layers call the tiled kernel.
LINEAR_OF_BUILD = {torch.bfloat16: (GemvLinearMethod.name,),
                   torch.float32: (Bf16WeightLinearMethod.name, F32GemvLinearMethod.name)}


def _shape_refusal(weights: DecoderWeights, float_methods: tuple[str, ...], methods: Mapping[tuple[int, int], str]) -> str | None:
    from radixserve.kernels.quant_tiled import load_tiled_kernel

    config = weights.config
    if config.hidden_size % 32 or config.head_dim % 32 or config.intermediate_size % 32:
        return "hidden, head or intermediate size not a multiple of 32"
    for i, layer in enumerate(weights.layers):
        for linear in layer.linears:
            name = linear.method.name if linear.method.chosen_by_format else methods.get(linear.shape, "dense")
            # NOTE: packed weights are tiled after the plan (model_quant.tile_packed_weights), where the tiled
            # kernels run; asked only for a packed layer, so that a float model never builds them
            if name == PackedLinearMethod.name and load_tiled_kernel() is None:
                return f"layer {i}: packed weights stay in the row layout here (no tiled kernels)"
            if name not in (*float_methods, PackedLinearMethod.name):
                return f"layer {i}: a linear layer runs {name}, not {' or '.join(float_methods)} or {PackedLinearMethod.name}"
        if any(linear.bias is not None for linear in layer.linears[1:]):
            return f"layer {i}: a biased o/gate_up/down layer"
    return None
