"""The `radixserve` command: generate, chat, bench, serve, cache.

Every subcommand takes the server arguments (`ServerArgs`, SGLang's names with dashes), e.g.
`--max-total-tokens 8192 --page-size 4 --disable-radix-cache`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from radixserve.server_args import ServerArgs


def _sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature; 0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=-1, help="top-k sampling; -1 is off (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: %(default)s)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divides the logits of tokens already in the conversation; 1.1-1.3 curbs the loops "
                             "small models fall into (default: %(default)s, off)")
    parser.add_argument("--stop", action="append", default=None,
                        help="stop string, repeatable (default: none)")


def _sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop or [],
            "repetition_penalty": args.repetition_penalty}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="An LLM serving engine built around "
                                     "SGLang's RadixAttention (prefix-sharing KV cache).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,bench,serve,cache}")

    gen = sub.add_parser("generate", help="generate a completion for one prompt",
                         description="Generate for one prompt, with the model's chat template unless --raw.")
    gen.add_argument("prompt", help="the user message (or the raw prompt with --raw)")
    gen.add_argument("--raw", action="store_true", default=False,
                     help="send the prompt as is, without the chat template (default: %(default)s)")
    gen.add_argument("--system", default=None, help="system message for the chat template (default: none)")
    gen.add_argument("--no-stream", action="store_true", default=False,
                     help="print the whole answer at the end instead of streaming it (default: %(default)s)")
    _sampling_args(gen, 128)
    ServerArgs.add_cli_args(gen)

    chat = sub.add_parser("chat", help="interactive multi-turn chat that reuses earlier turns' KV",
                          description="Interactive chat. Each turn resends the whole conversation; the radix "
                          "cache serves the earlier turns, and the cached-token count is shown per turn. "
                          "Commands: /reset clears the conversation, /exit quits.")
    chat.add_argument("--system", default=None, help="system message (default: none)")
    _sampling_args(chat, 256)
    ServerArgs.add_cli_args(chat)

    bench = sub.add_parser("bench", help="W1/W2/W3 workloads with the radix cache on and off",
                           description="Benchmark: W1 shared prefix, W2 no sharing, W3 multi-turn, each with the "
                           "radix cache on and off; prints a table, writes docs/benchmarks.md and a PNG.")
    from radixserve.bench.main import add_bench_args

    add_bench_args(bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Start the HTTP server (OpenAI-compatible and SGLang's /generate).")
    from radixserve.launch_server import add_serve_args

    add_serve_args(serve)  # the server arguments plus the HTTP-only flags (docs/server.md)
    from radixserve.entrypoints.dp_launcher import add_dp_args

    add_dp_args(serve)  # --dp N: N workers behind SGLang's model gateway (docs/scale_out.md)

    cache = sub.add_parser("cache", help="print a running server's radix tree and recent cache events",
                           description="Fetch /cache/tree from a running server and print the tree (one line "
                           "per node: namespace, length, lock count, evictable or protected, hits, age, tokens "
                           "and their text), the KV pool and the newest events.")
    cache.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    cache.add_argument("--api-key", default=None, help="the server's API key, if it has one (default: none)")
    cache.add_argument("--max-nodes", type=int, default=400, help="nodes nearest the root (default: %(default)s)")
    cache.add_argument("--max-tokens", type=int, default=16, help="tokens shown per node (default: %(default)s)")
    cache.add_argument("--full", action="store_true", default=False,
                       help="show every token of every node (up to 4096 a node) (default: %(default)s)")
    cache.add_argument("--events", type=int, default=20, help="newest events to print (default: %(default)s)")
    cache.add_argument("--json", action="store_true", default=False,
                       help="print the snapshot as JSON instead (default: %(default)s)")
    return parser


def _engine(args: argparse.Namespace) -> Any:
    from radixserve.entrypoints.engine import Engine

    server_args = ServerArgs.from_cli_args(args)
    print(f"loading {server_args.model_path or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr, flush=True)
    return Engine(**dataclasses.asdict(server_args))


def cmd_generate(args: argparse.Namespace) -> None:
    engine = _engine(args)
    try:
        if args.raw:
            ids = engine.tokenizer.encode(args.prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            ids = engine.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
        params = _sampling_params(args)
        if args.no_stream:
            out = engine.generate(input_ids=ids, sampling_params=params)
            print(out["text"])
            meta = out["meta_info"]
        else:
            meta = _stream_to_stdout(engine.generate(input_ids=ids, sampling_params=params, stream=True))
        print(_meta_line(meta), file=sys.stderr)
    finally:
        engine.shutdown()


def _stream_to_stdout(chunks: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for chunk in chunks:
        print(chunk["text"], end="", flush=True)
        meta = chunk["meta_info"]
    print()
    return meta


def _meta_line(meta: dict[str, Any]) -> str:
    reason = (meta.get("finish_reason") or {}).get("type")
    ttft = meta.get("ttft")
    spec = (f", {meta['spec_accepted_tokens']}/{meta['spec_draft_tokens']} draft tokens accepted, "
            f"{meta['spec_accept_length']:.2f} tokens per verify") if meta.get("spec_verify_ct") else ""
    return (f"[{meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} cached, "
            f"{meta['completion_tokens']} generated{spec}, finish: {reason}, "
            f"TTFT {ttft if ttft is None else round(ttft, 3)} s, total {meta['e2e_latency']:.2f} s]")


def cmd_chat(args: argparse.Namespace) -> None:
    engine = _engine(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("radixserve chat: /reset clears the conversation, /exit quits.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                messages = list(system)
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            chunks = engine.generate(input_ids=engine.apply_chat_template(messages),
                                     sampling_params=_sampling_params(args), stream=True)
            text, meta = "", {}
            for chunk in chunks:
                print(chunk["text"], end="", flush=True)
                text += chunk["text"]
                meta = chunk["meta_info"]
            print()
            print(_meta_line(meta), file=sys.stderr)
            messages.append({"role": "assistant", "content": text})
    finally:
        engine.shutdown()


def cmd_bench(args: argparse.Namespace) -> None:
    from radixserve.bench.main import run_bench

    run_bench(args)


def cmd_serve(args: argparse.Namespace) -> None:
    # NOTE: the server and its dependencies load only for `serve` (run_serve imports them).
    if args.dp != 1:
        from radixserve.entrypoints.dp_launcher import run_dp

        run_dp(args)
        return
    from radixserve.launch_server import run_serve

    run_serve(args)


def cmd_cache(args: argparse.Namespace) -> None:
    import json

    import httpx

    from radixserve.mem_cache.cache_view import format_events, format_pool, format_tree

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    query = {"max_nodes": args.max_nodes, "max_tokens": 4096 if args.full else args.max_tokens}
    try:
        r = httpx.get(args.base_url.rstrip("/") + "/cache/tree", params=query, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        sys.exit(f"cannot reach {args.base_url}: {e}")
    if r.status_code != 200:
        sys.exit(f"{args.base_url} answered {r.status_code}: {r.text}")
    snapshot = r.json()
    if args.json:
        print(json.dumps(snapshot, indent=1))
        return
    print(format_tree(snapshot))
    print(format_pool(snapshot))
    if args.events > 0 and snapshot["events"]:
        print("recent events:\n" + format_events(snapshot, args.events))


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve,
            "cache": cmd_cache}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
