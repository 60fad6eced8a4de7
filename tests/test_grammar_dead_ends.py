"""Grammars no output can match, or not within min_new_tokens: a 400 naming the field, never a 500.

Refused before the request runs where the grammar shows it (a rule that never ends, no first token, only the
empty output under min_new_tokens, a schema keyword xgrammar would ignore); at run time, where a row has no
token left (the grammar allows none, or only the stop tokens min_new_tokens bans), the request ends with a 400
too. Both loops, greedy, sampled-first and masked-first rows; conservation after every test (the `engines`
fixture's check), and the scheduler goes on serving.
"""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerHandle

PROMPT = "Answer in JSON."
REF_CYCLE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# NOTE: sampled first (greedy, plain temperature), masked first (top_p, logprobs)
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.9, "top_p": 0.9, "seed": 2}]

REFUSED_BEFORE_RUNNING = [
    ({"json_schema": REF_CYCLE}, "invalid grammar: json_schema: no output can match it: rule 'root' never ends"),
    ({"regex": r"[^\s\S]"}, "invalid grammar: regex: no output can match it (the grammar allows no first token)"),
    ({"ebnf": r"root ::= [^\x00-\U0010FFFF]"}, "invalid grammar: ebnf: no output can match it (the grammar allows "
                                               "no first token)"),
    ({"ebnf": 'root ::= "a" root'}, "invalid grammar: ebnf: no output can match it: rule 'root' never ends"),
    ({"json_schema": {"not": {}}}, "invalid grammar: json_schema: keyword 'not' (at #) is not supported"),
    ({"json_schema": {"type": "object", "properties": {"not": {"type": "integer"}, "b": {"if": {"minimum": 3}}}}},
     "invalid grammar: json_schema: keyword 'if' (at #/properties/b) is not supported"),
    ({"ebnf": 'root ::= ""', "min_new_tokens": 3}, "min_new_tokens: the ebnf grammar only matches the empty output"),
    ({"structural_tag": {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<a>"], "tags": [{"type": "tag", "begin": "<a>", "end": "</a>",
                                                                 "content": {"type": "json_schema",
                                                                             "json_schema": {"not": {}}}}]}}},
     "invalid grammar: structural_tag: keyword 'not' (at /format/tags/0/content/json_schema #) is not supported"),
]

ENDED_WHILE_RUNNING = [
    ({"regex": "a", "min_new_tokens": 10}, "min_new_tokens: the regex grammar must end after 1 token(s), before "
                                           "min_new_tokens (10)"),
    ({"json_schema": {"enum": ["x", "yes"]}, "min_new_tokens": 10}, "min_new_tokens: the json_schema grammar must "
                                                                     "end after"),
    ({"json_schema": {"type": "string", "pattern": r"[^\s\S]"}}, "invalid grammar: json_schema: no output can match "
                                                                 "it: after 1 token(s) the grammar allows no next token"),
]


def _assert_400(out: dict, message: str) -> None:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert reason["message"].startswith(message), reason["message"]


def _serves_on(engine) -> None:
    after = engine.generate(PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert after["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(("params", "message"), REFUSED_BEFORE_RUNNING)
def test_an_impossible_grammar_is_refused_before_running(engines, params, message):
    for engine in engines:
        out = engine.generate(PROMPT, sampling_params={**params, "max_new_tokens": 16})
        _assert_400(out, message)
        assert out["output_ids"] == [] and out["meta_info"]["prompt_tokens"] > 0
        _serves_on(engine)


@pytest.mark.parametrize(("params", "message"), ENDED_WHILE_RUNNING)
def test_a_grammar_dead_end_while_running_is_a_400(engines, params, message):
    for engine in engines:
        outs = engine.generate([PROMPT] * len(SAMPLINGS), sampling_params=[
            {**params, **sampling, "max_new_tokens": 16} for sampling in SAMPLINGS])
        logprobs = engine.generate(PROMPT, sampling_params={**params, "max_new_tokens": 16}, return_logprob=True,
                                   top_logprobs_num=2)
        for out in [*outs, logprobs]:
            _assert_400(out, message)
        _serves_on(engine)


def test_a_token_the_mask_allowed_but_the_grammar_refuses_stays_a_500(engines, monkeypatch):
    """Our bug (a row sampled outside an allowed mask) is no client error: a 500, as before."""
    from radixserve.constrained import grammar_backend

    engine = engines[1]
    monkeypatch.setattr(grammar_backend.Grammar, "fill_row", lambda self, bitmask, row: None)
    monkeypatch.setattr(grammar_backend.Grammar, "allows", lambda self, token: True)
    out = engine.generate(PROMPT, sampling_params={"regex": "(yes|no)", "max_new_tokens": 8, "temperature": 0})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert reason["message"].startswith("the grammar rejected token")


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 16,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": {"not": {}}}}},
     "json_schema: keyword 'not'"),
    ("/generate", {"text": "x", "sampling_params": {"regex": r"[^\s\S]", "max_new_tokens": 8}}, "regex: no output"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "min_new_tokens": 5, "max_new_tokens": 8}},
     "min_new_tokens: the regex grammar must end"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": REF_CYCLE}}}, "json_schema: no output"),
])
def test_an_impossible_grammar_is_an_http_400(api_server: ServerHandle, path: str, body: dict, field: str) -> None:
    r = httpx.post(api_server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text
