"""The `radixserve` command: help texts, generate, chat (cached tokens per turn), bench (smoke), serve."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve import cli
from radixserve.server_args import ServerArgs

SMALL = ["--dtype", "float32", "--max-total-tokens", "2048", "--disable-overlap-schedule", "--log-level", "warning"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_subcommand_documents_its_default():
    subs = _subparsers(cli.build_parser())
    assert set(subs) == {"generate", "chat", "bench", "serve", "cache"}
    server_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)}
    for name, sub in subs.items():
        options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        flags = {s for a in options for s in a.option_strings}
        if name != "cache":  # a client of a running server: it takes no engine arguments
            assert server_flags <= flags, (name, server_flags - flags)
        for action in options:
            assert "default" in (action.help or ""), (name, action.option_strings)
    text = subs["bench"].format_help()
    assert "--max-total-tokens" in text and "40960" in text  # the bench's own default, stated


@pytest.fixture
def fast_load(monkeypatch, loaded):
    """Every Engine the CLI builds reuses one loaded model."""
    import radixserve.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loaded)


def test_generate_raw_and_chat_template(fast_load, capsys):
    cli.main(["generate", "--raw", "--no-stream", "--max-new-tokens", "5", "--temperature", "0",
              "The capital of France is", *SMALL])
    out, err = capsys.readouterr()
    assert out.strip() and "5 generated" in err and "finish: length" in err
    cli.main(["generate", "--max-new-tokens", "6", "--temperature", "0", "What is 2+2?", *SMALL])
    out, err = capsys.readouterr()
    assert out.strip() and "prompt tokens" in err
    # the chat template wraps the message, so the prompt is much longer than the raw question
    assert int(err.split("[")[1].split()[0]) > 10
    loop = ["generate", "--raw", "--no-stream", "--max-new-tokens", "8", "--temperature", "0",
            "one two three one two three one two three", *SMALL]
    cli.main(loop)
    plain = capsys.readouterr().out
    cli.main([*loop, "--repetition-penalty", "2.0"])
    assert capsys.readouterr().out != plain  # the flag reaches the sampler


def test_chat_shows_cached_tokens_per_turn(fast_load, capsys, monkeypatch):
    lines = iter(["Name a fruit.", "And a color?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    cli.main(["chat", "--max-new-tokens", "8", "--temperature", "0", *SMALL])
    _, err = capsys.readouterr()
    turns = [line for line in err.splitlines() if "prompt tokens" in line]
    assert len(turns) == 2
    cached = [int(t.split(", ")[1].split()[0]) for t in turns]
    assert cached[0] == 0 and cached[1] > 10  # turn 2 reuses turn 1's KV


@pytest.mark.long
def test_bench_smoke_writes_table_section_and_plot(fast_load, capsys, tmp_path):
    md, png = tmp_path / "benchmarks.md", tmp_path / "bench.png"
    md.write_text("# Benchmarks\n\n## someone else's section\nkeep me\n")
    args = ["bench", "--scale", "0.06", "--output", str(md), "--plot", str(png), *SMALL]
    cli.main(args)
    cli.main(args)  # a second run replaces our section instead of appending
    out = capsys.readouterr().out
    assert "| W1 | on |" in out and "| W3 | off |" in out and "W1 prefill tokens computed cut" in out
    text = md.read_text()
    assert text.count("<!-- radixserve-bench:start -->") == 1 and "keep me" in text
    assert "vLLM-cpu" in text and png.stat().st_size > 1000


def test_serve_hands_server_args_to_the_http_server(monkeypatch):
    import radixserve.entrypoints.http_server as http_server

    seen = {}
    monkeypatch.setattr(http_server, "launch_server", lambda args, *rest: seen.setdefault("args", args))
    cli.main(["serve", "--port", "31234", "--page-size", "4"])
    assert seen["args"].port == 31234 and seen["args"].page_size == 4
