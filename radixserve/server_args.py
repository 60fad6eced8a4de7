"""One set of server arguments, shared by `Engine(...)` keywords and the CLI flags (SGLang's names)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixserve.configs.speculative import ALGORITHMS as SPECULATIVE_ALGORITHMS
from radixserve.configs.speculative import SpecConfig
from radixserve.function_call.formats import TOOL_CALL_PARSERS
from radixserve.function_call.reasoning import REASONING_PARSERS
from radixserve.mem_cache.storage.base import STORAGE_BACKENDS as HICACHE_STORAGE_BACKENDS
from radixserve.mem_cache.storage.base import WRITE_POLICIES as HICACHE_WRITE_POLICIES
from radixserve.mem_cache.storage.base import parse_size

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float32")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority", "slru")
QUANTIZATIONS = ("none", "int8", "int4")
EMBEDDING_POOLINGS = ("last", "mean")  # NOTE: layers/pooler.py computes each
# NOTE: the per-request size bounds the HTTP front end checks before any work (FrontendConfig carries them).
REQUEST_BOUNDS = ("max_stop_string_chars", "max_stop_token_ids", "max_logit_bias_entries", "max_chat_messages",
                  "max_id_chars", "max_request_items")
# NOTE: the other ServerArgs fields the HTTP process applies; FrontendConfig takes their defaults from here.
FRONTEND_LIMITS = ("max_request_fanout", "max_queued_requests", "fair_share_slice", "frontend_workers",
                   "max_frontend_queue", "keyless_rate_limit", "tool_call_parser", "reasoning_parser")


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _opt(None, "HF model folder or GGUF file; none means the embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = _opt(None, "name reported by /v1/models (default: derived from the model path)")
    dtype: str = _opt("auto", "compute dtype; auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, "
                              "else float32", DTYPES)
    kv_cache_dtype: str = _opt("auto", "dtype of the KV cache; bfloat16 (bf16) under float32 compute halves the "
                                       "bytes decode reads and doubles the tokens the pool holds; auto: the compute "
                                       "dtype, or bf16 where --dtype auto keeps bf16 weights under float32 compute "
                                       "(docs/kv_cache_dtype.md)", KV_CACHE_DTYPES)
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when present)")
    quantization: str = _opt("none", "packed linear weights on the CPU (GGUF tensors keep their nearest format)",
                             QUANTIZATIONS)
    context_length: int | None = _opt(None, "maximum context; default: the model's own")
    page_size: int = _opt(1, "tokens per KV page; radix matches are rounded down to a page")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens; default: from --mem-fraction-static")
    mem_fraction_static: float | None = _opt(None, "fraction of free device memory for the KV pool")
    chunked_prefill_size: int = _opt(2048, "largest prefill chunk in tokens; -1 disables chunking")
    max_prefill_tokens: int = _opt(16384, "prefill token budget of one batch")
    max_running_requests: int | None = _opt(None, "most requests in the running batch; default: from the pool size")
    schedule_policy: str = _opt("lpm", "waiting-queue order", SCHEDULE_POLICIES)
    schedule_conservativeness: float = _opt(1.0, "scales the decode-token reserve; higher retracts less")
    radix_eviction_policy: str = _opt("lru", "which unlocked leaf the radix cache evicts first", EVICTION_POLICIES)
    disable_radix_cache: bool = _opt(False, "no prefix reuse; every request computes its whole prompt")
    swa_full_tokens_ratio: float = _opt(0.5, "sliding-window models: tokens of the window layers' KV pool per token "
                                             "of the full layers' pool (docs/sliding_window.md)")
    disable_hybrid_swa_memory: bool = _opt(False, "sliding-window models keep every layer's KV for every token in "
                                                  "one pool (the window is then only a mask)")
    enable_hierarchical_cache: bool = _opt(False, "keep radix-cache pages on disk too, so a prefix's KV outlives the "
                                                  "KV pool and the process (docs/hicache.md)")
    hicache_storage_backend: str = _opt("file", "the disk tier's store: file (one file per page in "
                                                "--hicache-storage-dir) or redis (one value per page in the "
                                                "Redis or Valkey server at --hicache-storage-url)",
                                        HICACHE_STORAGE_BACKENDS)
    hicache_storage_dir: str | None = _opt(None, "the file store's directory; default: hicache/ under "
                                                 "RADIXSERVE_CACHE_DIR")
    hicache_storage_url: str | None = _opt(None, "the redis store's server, e.g. redis://127.0.0.1:6379/0 "
                                                 "(rediss:// for TLS, unix:///path.sock); its maxmemory caps it")
    hicache_storage_size: str | int = _opt("8GiB", "the file store's size cap in bytes (an int or e.g. 2GiB, "
                                                   "500MB); least recently used pages go first")
    hicache_write_policy: str = _opt("write_through", "when pages are stored: write_through (on insert into the "
                                                      "tree), write_through_selective (at a page's second hit), "
                                                      "write_back (on eviction from the tree)", HICACHE_WRITE_POLICIES)
    hicache_size: float = _opt(0.0, "the host-memory tier in front of the disk tier, in GB (1e9 bytes); 0: see "
                                    "--hicache-ratio (docs/hicache.md)")
    hicache_ratio: float = _opt(0.0, "the host-memory tier's size as a multiple of the KV pool's bytes (when "
                                     "--hicache-size is 0); both 0 (the default): no host tier")
    hicache_host_dtype: str = _opt("auto", "the host tier's page dtype: auto (the KV pool's, bit-identical loads), "
                                           "bfloat16, float16 or float32", ("auto", "bfloat16", "float16", "float32"))
    kv_events_config: str | None = _opt(None, "publish the radix cache's KV events (BlockStored, BlockRemoved, "
                                              "AllBlocksCleared) for a cache-aware router, as SGLang's JSON: "
                                              "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                                              "\"topic\": \"kv\"}' (docs/server.md#kv-events)")
    queue_timeout: float | None = _opt(None, "seconds a request may wait for admission; then it ends with 503")
    max_sessions: int = _opt(256, "most open agent sessions (/open_session) at once (docs/radix_cache.md)")
    session_max_tokens: int | None = _opt(None, "most tokens of one session's context pinned in the radix cache "
                                                "(its head); default: --session-max-pinned-tokens")
    session_max_pinned_tokens: int | None = _opt(None, "most tokens pinned by all sessions together (least recently "
                                                       "used session unpinned first); default: half the KV pool")
    session_idle_timeout_s: float = _opt(600.0, "seconds a session may stay idle; then it is unpinned and closed")
    grammar_compile_timeout: float = _opt(30.0, "seconds a request's grammar (json_schema, regex, ebnf, "
                                                "structural_tag) may take to compile; then it ends with 400")
    grammar_cache_bytes: int = _opt(256 << 20, "bytes of compiled grammars kept (ours and xgrammar's caches "
                                               "together, least recently used first); one grammar over it is a 400")
    disable_jump_forward: bool = _opt(False, "never append a grammar's forced continuation without decode steps "
                                             "(docs/structured_outputs.md)")
    embedding_pooling: str = _opt("last", "how /v1/embeddings pools the final norm's output over a prompt: last "
                                          "(its last token; a cached prefix is reused) or mean (every token; "
                                          "computed whole) (docs/server.md#embeddings)", EMBEDDING_POOLINGS)
    tool_call_parser: str = _opt("auto", "the text format of tool calls: auto (from the chat template; SmolLM2's "
                                         "own for a template without tools), hermes (also Qwen 2.5), llama3, "
                                         "mistral, smollm2", TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _opt(None, "split the chat answer's think block into reasoning_content: "
                                              "deepseek-r1 (the template opens <think>) or qwen3 "
                                              "(docs/server.md#reasoning-output); none: no split",
                                        REASONING_PARSERS)
    speculative_algorithm: str = _opt("none", "speculative decoding: ngram drafts from the request's own prompt "
                                              "and output, or standalone: a smaller draft model's, verified "
                                              "exactly by the model (docs/speculative.md)", SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: str | None = _opt(None, "the draft model of --speculative-algorithm standalone "
                                                          "(same vocabulary); none: the embedded SmolLM2-135M")
    speculative_draft_model_quantization: str = _opt("none", "packed weights for the draft model (as "
                                                             "--quantization): a quantized copy of the served "
                                                             "model is a cheap draft of it", QUANTIZATIONS)
    speculative_num_draft_tokens: int = _opt(6, "most draft tokens a request proposes per step")
    speculative_ngram_min_match: int = _opt(2, "shortest suffix (tokens) an n-gram draft may match")
    speculative_ngram_max_match: int = _opt(8, "longest suffix (tokens) an n-gram draft tries first")
    speculative_max_verify_rows: int = _opt(32, "most rows (requests + draft tokens) a verify step runs; drafts "
                                                "are cut to fit, the best-accepted requests first")
    enable_lora: bool = _opt(False, "serve LoRA adapters (implied by --lora-paths); adapters may then be loaded "
                                    "at run time too (docs/lora.md)")
    lora_paths: tuple[str, ...] = _opt((), "LoRA adapters to load at start, each name=path of a PEFT folder "
                                       "or a llama.cpp GGUF adapter file")
    max_loras_per_batch: int = _opt(8, "most distinct LoRA adapters in one running batch")
    max_lora_rank: int = _opt(64, "highest LoRA rank an adapter may have")
    max_loaded_loras: int | None = _opt(None, "most adapters packed for the forward at once (least recently used "
                                              "out); default: --max-loras-per-batch")
    disable_overlap_schedule: bool = _opt(False, "use event_loop_normal instead of event_loop_overlap")
    attention_backend: str = _opt("auto", "attention backend: auto (cpu kernels on a CPU, triton on CUDA where "
                                          "triton is installed, else torch), cpu, torch, triton")
    cuda_graph_max_bs: int | None = _opt(None, "largest decode batch replayed from a captured CUDA graph (buckets "
                                               "1, 2, 4, 8, then every 8 up to it); default: min(160, "
                                               "--max-running-requests) (docs/attention.md, CUDA graphs)")
    disable_cuda_graph: bool = _opt(False, "run every decode step eagerly on CUDA (no graph capture at start-up)")
    disable_cascade_attention: bool = _opt(False, "never split attention over a prefix shared by the whole batch")
    enable_deterministic_inference: bool = _opt(False, "batch-invariant inference: a request's logprobs are the same "
                                                       "bits whatever else runs, however its prompt is chunked or "
                                                       "cached (CPU, float32 compute; docs/deterministic.md)")
    linear_method: str = _opt("auto", "how linear layers keep and multiply weights: auto (measured per shape), "
                                      "dense (F.linear), onednn (prepacked, CPU)")
    disable_fused_ops: bool = _opt(False, "run RMSNorm+add, rotary+KV write and SiLU-and-mul as eager torch "
                                          "instead of compiled CPU ops")
    torch_threads: int | None = _opt(None, "torch intra-op threads for the forward; default: torch's own choice")
    random_seed: int | None = _opt(None, "seed for sampling of requests without their own seed")
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(None, "comma-separated API keys; each key gets its own cache namespace")
    admin_api_key: str | None = _opt(None, "the operator's key: /flush_cache, aborting any request, server "
                                           "internals in /get_server_info, /metrics (docs/server.md)")
    metrics_public: bool = _opt(False, "/metrics needs no key even when keys are set")
    max_request_fanout: int = _opt(256, "most sequences (prompts x n) one request may run; more is a 400")
    max_queued_requests: int = _opt(1024, "most sequences waiting for the scheduler; more get 503 with Retry-After")
    fair_share_slice: int = _opt(16, "sequences of one request queued in the scheduler at a time (fair sharing)")
    max_stop_string_chars: int = _opt(1024, "longest stop string of a request; longer is a 400")
    max_stop_token_ids: int = _opt(1024, "most stop token ids of a request; more is a 400")
    max_logit_bias_entries: int = _opt(1024, "most logit_bias entries of a request; more is a 400")
    max_chat_messages: int = _opt(1024, "most messages of one chat request; more is a 400")
    max_id_chars: int = _opt(256, "longest rid, cache_salt or extra_key; longer is a 400")
    max_request_items: int = _opt(65536, "most per-sequence items one request may fan out: sequences x (stop "
                                         "token ids + logit_bias entries + stop strings); more is a 400")
    frontend_workers: int = _opt(1, "processes that parse and validate request bodies, and threads that render "
                                    "big answers, in the HTTP process (tokenizing has one thread of its own)")
    max_frontend_queue: int = _opt(512, "most requests waiting for a front-end thread; more get 503 (each key "
                                        "keeps its share)")
    keyless_rate_limit: float = _opt(20.0, "requests per second (and burst) that /health_generate and /get_load "
                                           "serve without a valid key; more get 429; 0: unlimited")
    responses_store_max_count: int = _opt(10000, "most stored /v1/responses answers kept in memory (all keys "
                                                 "together; least recently used go first)")
    responses_store_max_bytes: int = _opt(256 << 20, "most bytes of stored /v1/responses answers kept in memory "
                                                     "(an estimate; least recently used go first)")
    log_level: str = _opt("info", "logging level")
    log_interval: int = _opt(40, "decode steps between decode log lines")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype.startswith(("fp8", "fp4")):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: the attention kernels read "
                             "bfloat16 or float32 K/V; bfloat16 is the smaller cache")
        for name in ("kv_cache_dtype", "dtype", "quantization", "schedule_policy", "radix_eviction_policy",
                     "tool_call_parser", "speculative_algorithm", "speculative_draft_model_quantization"):
            choices = _choices(name)
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling={self.embedding_pooling!r} is not one of {', '.join(EMBEDDING_POOLINGS)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size * 2:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} is too small")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("chunked_prefill_size must be positive, or -1 to disable chunking")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.grammar_cache_bytes < 1 << 20:
            raise ValueError(f"grammar_cache_bytes must be at least 1 MiB (1048576), got {self.grammar_cache_bytes}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        if self.max_sessions < 0 or not self.session_idle_timeout_s > 0:
            raise ValueError("max_sessions must be >= 0 and session_idle_timeout_s positive, got "
                             f"{self.max_sessions} and {self.session_idle_timeout_s}")
        for name in ("session_max_tokens", "session_max_pinned_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout must be positive, got {self.queue_timeout}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.speculative_algorithm != "none":
            SpecConfig.of(self)  # NOTE: raises ValueError naming the bad value
        if self.keyless_rate_limit < 0:
            raise ValueError(f"keyless_rate_limit must be >= 0, got {self.keyless_rate_limit}")
        for name in ("max_request_fanout", "max_queued_requests", "fair_share_slice", "frontend_workers",
                     "max_frontend_queue", "responses_store_max_count", "responses_store_max_bytes",
                     *REQUEST_BOUNDS):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_lora()
        self._check_hicache()
        if self.max_request_fanout > self.max_queued_requests:
            raise ValueError(f"max_request_fanout={self.max_request_fanout} is over max_queued_requests="
                             f"{self.max_queued_requests}: such a request could never be queued")

    def _check_hicache(self) -> None:
        for name, choices in (("hicache_storage_backend", HICACHE_STORAGE_BACKENDS),
                              ("hicache_write_policy", HICACHE_WRITE_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        parse_size(self.hicache_storage_size)  # NOTE: raises ValueError naming hicache_storage_size
        if self.hicache_storage_backend == "redis":
            from radixserve.mem_cache.storage.redis_backend import check_redis_url

            check_redis_url(self.hicache_storage_url)  # NOTE: raises ValueError naming hicache_storage_url
        for name in ("hicache_size", "hicache_ratio"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number >= 0")
            if getattr(self, name) and not self.enable_hierarchical_cache:
                raise ValueError(f"{name} sizes the hierarchical cache's host tier: add enable_hierarchical_cache")
        if self.hicache_host_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"hicache_host_dtype={self.hicache_host_dtype!r} is not one of auto, bfloat16, float16, "
                             "float32")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache: drop disable_radix_cache")
        from radixserve.mem_cache.kv_events import KVEventsConfig

        KVEventsConfig.from_json(self.kv_events_config)  # NOTE: raises ValueError naming kv_events_config

    def _check_lora(self) -> None:
        if isinstance(self.lora_paths, (str, list)):  # NOTE: a list from Engine(...) kwargs, a str for one adapter
            object.__setattr__(self, "lora_paths", (self.lora_paths,) if isinstance(self.lora_paths, str)
                               else tuple(self.lora_paths))
        for name in ("max_loras_per_batch", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"max_loaded_loras={self.max_loaded_loras} is below max_loras_per_batch="
                             f"{self.max_loras_per_batch}: one batch's adapters must fit at once")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @property
    def api_keys(self) -> list[str]:
        return [k for k in (self.api_key or "").split(",") if k]

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} (default: {f.default})"
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            if str(f.type).startswith("tuple"):
                parser.add_argument(flag, nargs="*", default=f.default, help=help_text)
                continue
            kind = _cli_type(f.type)
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"], help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names})


def _choices(name: str) -> tuple:
    return next(f.metadata["choices"] for f in dataclasses.fields(ServerArgs) if f.name == name)


def _cli_type(annotation: str) -> type:
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str
