"""The offline Engine: the scheduler in a background thread of this process, driven through its queue.

It drives the scheduler through a `SchedulerClient` (radixserve/client/, the one the HTTP server drives too) over
an in-process transport: the scheduler's `input_queue` in, its `output_sink` called on the scheduler thread out.

    from radixserve import Engine
    engine = Engine(max_total_tokens=4096)
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    print(out["text"], out["meta_info"]["cached_tokens"])
    engine.shutdown()
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from radixserve.client.scheduler_client import InProcessTransport, SchedulerClient
from radixserve.entrypoints.request_state import RequestHandle, RequestState
from radixserve.protocol.io_struct import (
    NO_LOGPROBS,
    FlushCacheOut,
    FlushCacheReq,
    GetInternalStateOut,
    GetInternalStateReq,
    ListLoraAdaptersReq,
    LoadLoraAdapterReq,
    LogprobSpec,
    LoraAdapterOut,
    UnloadLoraAdapterReq,
)
from radixserve.protocol.requests import check_request, generate_message, per_choice_params
from radixserve.sampling_params import SamplingParams, check_input_ids
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
SamplingArg = SamplingParams | dict[str, Any] | list[SamplingParams | dict[str, Any]] | None


class Engine:
    """`Engine(model_path=None, **server_args)`: the names of `ServerArgs`, as SGLang names them.

    `loaded_model` (a `LoadedModel` of `models.loader.load_model`, e.g. `other_engine.model_runner.loaded`)
    reuses weights already in memory, to run two configurations without loading twice.
    """

    def __init__(self, model_path: str | None = None, *, loaded_model: Any = None, **kwargs: Any) -> None:
        from radixserve.managers.scheduler_process import build_scheduler

        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        _configure_logging(self.server_args.log_level)
        self._control_lock = threading.Lock()
        self._error: BaseException | None = None
        self.scheduler, self.info = build_scheduler(self.server_args, self._on_output, loaded_model)
        self.model_runner = self.scheduler.model_runner
        self.tokenizer = self.info.tokenizer
        self.limits = self.info.limits
        # NOTE: the scheduler's client, the HTTP server's too; this class adds threads and the in-process transport
        self.client: SchedulerClient[RequestState] = SchedulerClient(InProcessTransport(self.scheduler.input_queue.put))
        self._thread = threading.Thread(target=self._run_scheduler, name="radixserve-scheduler", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------------
    def generate(self, prompt: Prompt = None, sampling_params: SamplingArg = None,
                 input_ids: list[int] | list[list[int]] | None = None, extra_key: Any = None,
                 stream: bool = False, return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1, lora_path: str | list[str | None] | None = None,
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list (a list back); `stream=True` yields increments.

        With `return_logprob`, `meta_info` holds `output_token_logprobs`, one (logprob, token id, text)
        per output token, and `output_top_logprobs`, the `top_logprobs_num` most likely per position;
        with `logprob_start_len` >= 0 also `input_token_logprobs` / `input_top_logprobs` of the prompt
        from that position on (None at position 0), computed, never read from the radix cache.
        `lora_path`: the name of a loaded LoRA adapter (SGLang's name for it), or one per prompt (None: the
        base model)."""
        batch, single = self._normalize_inputs(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(batch))
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(batch)
        if len(loras) != len(batch):
            raise ValueError(f"{len(loras)} lora_path entries for {len(batch)} prompts")
        logprob = LogprobSpec(return_logprob, top_logprobs_num, logprob_start_len)
        if stream:
            if not single or params[0].n != 1:
                raise ValueError("stream=True takes one prompt with n=1")
            return self.submit(batch[0], params[0], extra_key, stream=True, logprob=logprob,
                               lora_path=loras[0]).stream()
        handles = [h for ids, p, lora in zip(batch, params, loras, strict=True)
                   for h in self._submit_n(ids, p, extra_key, logprob, lora)]
        results = [h.result() for h in handles]
        return results[0] if single and len(results) == 1 else results

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingArg = None, extra_key: Any = None,
             stream: bool = False, lora_path: str | None = None,
             **logprobs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Apply the model's chat template to `messages` and generate the assistant's answer."""
        return self.generate(input_ids=self.apply_chat_template(messages), sampling_params=sampling_params,
                             extra_key=extra_key, stream=stream, lora_path=lora_path, **logprobs)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def submit(self, input_ids: list[int], sampling_params: SamplingParams | dict[str, Any] | None = None,
               extra_key: Any = None, stream: bool = False, rid: str | None = None,
               logprob: LogprobSpec = NO_LOGPROBS, lora_path: str | None = None) -> RequestHandle:
        """Queue one request and return at once; the handle waits for, streams or aborts it."""
        self._raise_if_dead()
        params = SamplingParams.from_any(sampling_params)
        # NOTE: the server's rules (sampling_params.py, protocol/requests.py), with this model's numbers.
        check_input_ids(input_ids, self.limits.vocab_size)
        params.verify_for_model(self.limits.vocab_size)
        error = check_request(input_ids, logprob, extra_key, self.limits)
        if error is not None:
            raise ValueError(error)
        self._check_adapter(lora_path)
        rid = rid or uuid.uuid4().hex
        state = RequestState(rid, list(input_ids), params, self.tokenizer, stream, logprob)
        self.client.track(rid, state)
        self.client.send_generate(generate_message(rid, input_ids, params, extra_key, logprob, lora_path))
        return RequestHandle(state, self)

    def abort(self, rid: str) -> None:
        """Abort a request at any stage; its KV is released within one scheduler step."""
        self.client.abort(rid)

    def flush_cache(self) -> dict[str, Any]:
        """Empty the radix cache when no request holds KV; says whether it did."""
        out: FlushCacheOut = self._control(FlushCacheReq(), FlushCacheOut)
        return {"success": out.success, "tokens_freed": out.tokens_freed, "message": out.message,
                "cache_epoch": out.cache_epoch}

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Registers a PEFT LoRA folder or a GGUF LoRA file under `lora_name`; raises ValueError (nothing
        changed) when it cannot."""
        return self._lora_control(LoadLoraAdapterReq(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Forgets an adapter and frees its cached KV; raises ValueError (404: unknown; 409: in use)."""
        return self._lora_control(UnloadLoraAdapterReq(lora_name))

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        """The registered adapters: name, path, rank, alpha, targets, content hash, whether packed now."""
        out: LoraAdapterOut = self._control(ListLoraAdaptersReq(), LoraAdapterOut)
        return out.adapters

    def _lora_control(self, msg: Any) -> dict[str, Any]:
        out: LoraAdapterOut = self._control(msg, LoraAdapterOut)
        if not out.success:
            raise ValueError(f"{out.message} (status {out.status_code})")
        return {"message": out.message, "adapters": out.adapters, "freed_tokens": out.freed_tokens}

    def _check_adapter(self, name: str | None) -> None:
        """An unknown adapter is refused here, naming it (the scheduler checks again on arrival)."""
        if name is None:
            return
        manager = self.model_runner.lora
        if manager is None:
            raise ValueError("LoRA is off on this engine; create it with enable_lora=True or lora_paths=[...]")
        if manager.get(name) is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(manager.registry) or 'none'})")

    def get_internal_state(self) -> dict[str, Any]:
        """Scheduler counters and pool sizes (prompt/cached/generated/evicted tokens, retractions...)."""
        out: GetInternalStateOut = self._control(GetInternalStateReq(), GetInternalStateOut)
        return out.state

    def shutdown(self) -> None:
        self.scheduler.stop_event.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._fail_all(RuntimeError("the engine was shut down"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------------
    def _normalize_inputs(self, prompt: Prompt, input_ids: Any) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("prompt must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts], single
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [list(input_ids)] if single or not input_ids else [list(x) for x in input_ids]
        return batch, single or not input_ids

    @staticmethod
    def _normalize_params(sampling_params: SamplingArg, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
            return [SamplingParams.from_any(p) for p in sampling_params]
        return [SamplingParams.from_any(sampling_params)] * n

    def _submit_n(self, ids: list[int], params: SamplingParams, extra_key: Any,
                  logprob: LogprobSpec, lora_path: str | None = None) -> list[RequestHandle]:
        return [self.submit(ids, p, extra_key, logprob=logprob, lora_path=lora_path) for p in per_choice_params(params)]

    def _control(self, msg: Any, reply_type: type) -> Any:
        with self._control_lock:  # NOTE: one at a time, so a reply cannot outrun the shutdown check
            self._raise_if_dead()
            future: Future = Future()
            self.client.ask(msg, reply_type, future)
            while True:
                try:
                    return future.result(timeout=0.5)
                except TimeoutError:
                    pass
                except BaseException:
                    self._raise_if_dead()  # NOTE: the scheduler died or the engine shut down: say which
                    raise
                self._raise_if_dead()

    def _on_output(self, out: Any) -> None:
        """Called on the scheduler thread for every message it sends."""
        batch = self.client.receive(out)
        if batch is not None:
            now = time.perf_counter()
            for state, record in self.client.route(batch):
                state.on_output(record, now)

    def _run_scheduler(self) -> None:
        try:
            self.scheduler.event_loop()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting caller
            logger.exception("scheduler thread died")
            self._error = e
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        for state in self.client.fail_all(error):
            state.fail(error)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread died: {self._error!r}") from self._error
        if self.scheduler.stop_event.is_set():
            raise RuntimeError("the engine was shut down")


def _configure_logging(level: str) -> None:
    root = logging.getLogger("radixserve")
    root.setLevel(level.upper())
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        root.addHandler(handler)
