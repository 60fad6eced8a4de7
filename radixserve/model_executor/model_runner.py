"""ModelRunner: owns the model, the KV pool, the request-to-token table, the allocator and the backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from radixserve import platform
from radixserve.cpu_memory import keep_freed_memory, serve_from_heap
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    TokenLogprobs,
    compute_input_logprobs,
    compute_logprobs,
)
from radixserve.mem_cache.kv_manager import WINDOW_SLIDE_TOKENS
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.mem_cache.swa_memory import SWAKVPool, SWATokenToKVPoolAllocator
from radixserve.model_executor.cuda_graph_runner import Graph, GraphDecodeRunner, GraphPlan
from radixserve.model_executor.device_setup import setup_model_for_device
from radixserve.model_executor.execution_plan import plan_execution
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.models.loader import LoadedModel

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MEM_FRACTION = {"cuda": 0.8, "cpu": 0.2}
# NOTE: without --max-total-tokens or --mem-fraction-static the CPU pool is capped here, because the
# pool is allocated (and zero-filled) up front and CPU machines are often shared.
DEFAULT_CPU_POOL_CAP = 65536
MAX_RUNNING_REQUESTS_CAP = 256
TOKENS_PER_RUNNING_REQUEST = 8  # default max_running_requests = pool tokens / this, capped above
REQ_TO_TOKEN_MARGIN = 4


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device_type: str = "cpu") -> torch.dtype:
    """`--dtype` to a torch dtype; auto is decided by the hardware (platform.choose_dtype)."""
    return DTYPES[platform.choose_dtype(name, device_type).dtype]


class ModelRunner:
    """Runs `forward(ForwardBatch)` to float32 logits [bs, vocab] and samples from them.

    A `loaded` model that is passed in is moved and cast to the runner's device and dtype in place.
    """

    def __init__(self, server_args: ServerArgs, loaded: LoadedModel | None = None) -> None:
        self.server_args = server_args
        self.device = resolve_device(server_args.device)
        self.dtype_choice = platform.choose_dtype(server_args.dtype, self.device.type)  # dtype and why
        self.dtype = DTYPES[self.dtype_choice.dtype]
        self.page_size = server_args.page_size
        self.malloc_tuned = self.device.type == "cpu" and keep_freed_memory()
        if self.malloc_tuned:
            serve_from_heap(on=False)  # NOTE: another runner of this process may have turned it on
        if server_args.torch_threads is not None:
            # NOTE: process-wide; set only when asked (on a busy machine 1 thread can beat 2)
            torch.set_num_threads(server_args.torch_threads)
        if server_args.quantization != "none" and self.device.type != "cpu":
            raise ValueError(f"--quantization {server_args.quantization} has no {self.device.type} path yet; "
                             "use --device cpu, or --quantization none")
        if loaded is None:
            from radixserve.models.loader import load_model

            loaded = load_model(server_args.model_path, self.dtype, self.device, server_args.quantization)
        self.loaded = loaded
        self.model = loaded.model.to(device=self.device, dtype=self.dtype)
        # NOTE: every choice of how a forward runs is made here, once; the parts then receive theirs
        self.execution_plan = plan_execution(self.model, self.device, self.dtype_choice, server_args)
        self.device_setup = setup_model_for_device(self.model, self.device, self.execution_plan)
        self.kv_dtype = self.execution_plan.kv_dtype  # the KV pool's (--kv-cache-dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.context_len = self._context_len()
        self.swa_window = self._hybrid_window()  # hybrid KV pool: the window W it keeps; None: one pool
        self.max_total_num_tokens = self._pool_size()
        self.max_running_requests = server_args.max_running_requests or min(
            MAX_RUNNING_REQUESTS_CAP, max(1, self.max_total_num_tokens // TOKENS_PER_RUNNING_REQUEST))
        self._init_pools()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self.device,
                                                     plan=self.execution_plan.attention)
        self.sampler = Sampler(server_args.random_seed, self.req_to_token_pool.size + 1,
                               exact_match_verify=server_args.enable_deterministic_inference)
        self.lora = self._init_lora() if server_args.lora_enabled else None  # lora/manager.LoraManager
        self.cuda_graphs: GraphDecodeRunner | None = None  # captured once (init_cuda_graphs); None: every step eager
        plan = self.execution_plan.cuda_graphs
        if plan is not None and plan.bs_list:
            self.init_cuda_graphs(plan)
        self.malloc_tuned = self.malloc_tuned and serve_from_heap()
        self._log_startup()

    def forward(self, forward_batch: ForwardBatch, read_done: Any = None) -> torch.Tensor:
        """Float32 logits: of each request's last new token (extend) or of each token (decode).

        `read_done` (an overlap_streams.Event, optional) is recorded once the forward has read every
        buffer the scheduler writes (`req_to_token` rows, through the backend's `init_forward_metadata`),
        so the scheduler may write them again from then on, while the layers still run.
        """
        if forward_batch.forward_mode == ForwardMode.IDLE:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.token_to_kv_pool = self.token_to_kv_pool
        forward_batch.attn_backend = self.attn_backend
        graphs = self.cuda_graphs
        with torch.inference_mode():
            if graphs is not None and graphs.refusal(forward_batch) is None:
                return graphs.replay(forward_batch, read_done)  # NOTE: it records read_done once rows are read
            if graphs is not None:
                graphs.note_eager(forward_batch)
            try:
                self.attn_backend.init_forward_metadata(forward_batch)
            finally:
                if read_done is not None:
                    read_done.record()
            logits = self._run_model(forward_batch)
            if forward_batch.extra_logits_indices is None:
                return logits
            bs = forward_batch.batch_size
            forward_batch.input_logprobs = compute_input_logprobs(
                logits[bs:], forward_batch.extra_target_ids, forward_batch.extra_top_k)
            return logits[:bs]

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        if self.lora is None:
            if fb.lora_adapters is not None:
                raise RuntimeError("a batch with LoRA adapters on a runner without LoRA")
            return self.model(fb.input_ids, fb.positions, fb)
        self.lora.prepare(fb)
        try:
            return self.model(fb.input_ids, fb.positions, fb)
        finally:
            self.lora.finish()

    def init_cuda_graphs(self, plan: GraphPlan, graph_factory: Callable[[], Graph] | None = None) -> None:
        """Captures decode at `plan`'s bucket sizes (at start-up: the execution plan's); the time is logged.
        `graph_factory`: CUDA graphs by default (the tests hand a stand-in that reruns the captured function)."""
        template = ForwardBatch.for_decode([0], [0], [1], torch.zeros(1, dtype=torch.int32), self.device)
        template.req_to_token_pool, template.token_to_kv_pool = self.req_to_token_pool, self.token_to_kv_pool
        template.attn_backend = self.attn_backend
        runner = GraphDecodeRunner(plan, self.attn_backend, self._run_model, template,
                                   self.req_to_token_pool.req_to_token.shape[1], self.device, graph_factory)
        with torch.inference_mode():
            runner.capture()
        self.cuda_graphs = runner

    def _init_lora(self) -> Any:
        from radixserve.lora.manager import LoraLimits, LoraManager, parse_lora_paths

        args = self.server_args
        limits = LoraLimits(args.max_lora_rank, args.max_loaded_loras or args.max_loras_per_batch,
                            args.max_loras_per_batch)
        manager = LoraManager(self.model, self.model_config, self.dtype, self.device, limits, self.execution_plan.rows)
        for name, path in parse_lora_paths(args.lora_paths):
            manager.register(name, path)
        return manager

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Next token per row, int64 [bs]."""
        with torch.inference_mode():
            return self.sampler(logits, sampling_info)

    def logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, sampling_info: SamplingBatchInfo,
                 top_k: int) -> TokenLogprobs:
        """Log-probabilities of the sampled tokens and of each row's `top_k` most likely tokens."""
        with torch.inference_mode():
            return compute_logprobs(logits, next_ids, sampling_info, top_k)

    @property
    def fast_decode_rows(self) -> int | None:
        """The most rows the model's fast decode path (the one-call C decoder) takes; None without one."""
        decoder = self.model.c_decoder
        return decoder.max_rows if decoder is not None and decoder.max_rows > 0 else None

    def _context_len(self) -> int:
        model_len = self.model_config.context_len
        wanted = self.server_args.context_length
        if wanted is None:
            return model_len
        if wanted > model_len:
            raise ValueError(f"context_length={wanted} is longer than the model's {model_len} positions")
        return wanted

    def _hybrid_window(self) -> int | None:
        """The window a hybrid pool keeps for window layers (the largest of the model's), or None: one pool."""
        windows = getattr(self.model_config, "windows", ())
        if not windows or self.server_args.disable_hybrid_swa_memory:
            return None
        return max(windows)

    def _pool_size(self) -> int:
        args = self.server_args
        bytes_per_token = self._bytes_per_token()
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            fraction = args.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device.type]
            tokens = int(_available_memory(self.device) * fraction // bytes_per_token)
            if self.device.type == "cpu" and args.mem_fraction_static is None:
                tokens = min(tokens, DEFAULT_CPU_POOL_CAP)
        tokens = tokens // self.page_size * self.page_size
        if tokens < 2 * self.page_size:
            raise ValueError(f"the KV pool would hold only {tokens} tokens; raise --max-total-tokens "
                             "or --mem-fraction-static")
        return tokens

    def _bytes_per_token(self) -> float:
        """KV bytes one full-pool token costs, with its share of the window pool on a hybrid model."""
        cfg = self.model_config
        if self.swa_window is None:
            return MHATokenToKVPool.bytes_per_token(cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, self.kv_dtype)
        full, windowed = SWAKVPool.split_bytes_per_token(cfg.num_kv_heads, cfg.head_dim, cfg.layer_windows,
                                                         self.kv_dtype)
        return full + self.server_args.swa_full_tokens_ratio * windowed

    def window_pool_size(self) -> int:
        """Window-pool tokens of a hybrid model: the ratio's share of the full pool, but at least a prefill chunk
        plus a window (so one request always progresses), and never more than the full pool."""
        args, window, page = self.server_args, self.swa_window, self.page_size
        chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else self.context_len
        drafts = args.speculative_num_draft_tokens if args.speculative_algorithm != "none" else 0
        # NOTE: a request holds the window lock's W - 1 tokens (whole pages) and either a prefill chunk or, while
        # it decodes, up to W + WINDOW_SLIDE_TOKENS of its own, a draft and the overlap loop's step ahead
        least = max(chunk, window + WINDOW_SLIDE_TOKENS + drafts + 2) + window + 2 * page
        wanted = int(self.max_total_num_tokens * self.server_args.swa_full_tokens_ratio)
        return min(self.max_total_num_tokens, max(wanted, least))

    def _init_pools(self) -> None:
        from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        cfg = self.model_config
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len + REQ_TO_TOKEN_MARGIN, self.device)
        if self.swa_window is not None:
            self.token_to_kv_pool_allocator = SWATokenToKVPoolAllocator(
                self.max_total_num_tokens, self.page_size, self.window_pool_size(), self.device)
            self.token_to_kv_pool = SWAKVPool(
                self.max_total_num_tokens, self.window_pool_size(), self.page_size, self.kv_dtype, cfg.num_kv_heads,
                cfg.head_dim, cfg.layer_windows, self.token_to_kv_pool_allocator.full_to_window, self.device)
            return
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens, self.page_size, self.kv_dtype, cfg.num_kv_heads, cfg.head_dim,
            cfg.num_layers, self.device)
        if self.page_size == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens, self.device)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                self.max_total_num_tokens, self.page_size, self.device)

    def platform_info(self) -> dict:
        """The dtype and why, the C attention kernels in use and the CPU (start-up line, /get_server_info)."""
        attention = self.execution_plan.attention
        kernels = None if attention.level is None else {"level": attention.level, "class": attention.kernel_class,
                                                        "used": attention.used(self.dtype)}
        return {"dtype": self.dtype_choice.dtype, "dtype_reason": self.dtype_choice.reason,
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "attention_kernels": kernels, "cpu": platform.describe(), "malloc_tuned": self.malloc_tuned,
                "execution_plan": self.execution_plan.as_dict(), "cuda_graphs": self._graph_info()}

    def _graph_info(self) -> dict | None:
        graphs = self.cuda_graphs
        if graphs is None:
            return None
        return {"batch_sizes": list(graphs.plan.bs_list), "capture_s": round(graphs.capture_s, 3)}

    def _log_startup(self) -> None:
        gib = sum(b.numel() * b.element_size() for b in self.token_to_kv_pool.k_buffer
                  + self.token_to_kv_pool.v_buffer) / 2**30
        if self.swa_window is not None:
            logger.info("hybrid KV pool: window layers keep %d tokens (window %d), full layers %d",
                        self.token_to_kv_pool.window_size, self.swa_window, self.max_total_num_tokens)
        from radixserve.layers.quantization.model_quant import weight_summary

        kernels = self.platform_info()["attention_kernels"]
        used = "torch only" if kernels is None else f"C {', '.join(kernels['used']) or 'none'} ({kernels['class']})"
        logger.info(
            "model %s | dtype %s (%s) | device %s | KV pool %d tokens (%s, %.2f GiB) | page size %d | "
            "max running requests %d | max context %d | speculative %s | attention %s, %s | quantization %s: %s | %s | "
            "malloc %s | CPU: %s",
            self.loaded.name, self.dtype_choice.dtype, self.dtype_choice.reason, self.device,
            self.max_total_num_tokens, str(self.kv_dtype).removeprefix("torch."), gib, self.page_size, self.max_running_requests, self.context_len,
            self.server_args.speculative_algorithm,
            self.server_args.attention_backend, used, self.server_args.quantization, weight_summary(self.model),
            self.device_setup.describe(), "kept" if self.malloc_tuned else "default", platform.summary_line())
        logger.info("execution plan:\n%s", self.execution_plan.describe())
        if self.max_total_num_tokens < self.context_len:
            logger.warning("the KV pool (%d tokens) is smaller than the context length (%d): one request "
                           "can use at most the pool", self.max_total_num_tokens, self.context_len)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return _cpu_available_bytes()


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
