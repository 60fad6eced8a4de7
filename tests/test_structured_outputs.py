"""Constrained decoding (constrained/, managers/grammar_manager.py) on the embedded model, both loops.

Every output of a `json_schema` request parses and validates (jsonschema), over generated schemas and
sampling settings; regex outputs full-match; EBNF outputs match the grammar; a permissive grammar leaves
greedy tokens unchanged; bad grammars end with a 400 naming the field; conservation holds after every test
(the `engines` fixture's check).
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from radixserve.sampling_params import SamplingParams, SamplingParamsError

PROMPT = "Answer in JSON. Describe a person with a name, an age and a city."

SAMPLINGS = [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.2, "top_p": 0.9, "top_k": 40, "seed": 5},
    {"temperature": 0.7, "min_p": 0.1, "seed": 3, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    {"temperature": 0, "logit_bias": {28: 5.0, 90: -5.0}},
]


def _property() -> st.SearchStrategy[dict]:
    words = st.text(alphabet="abcdefghij", min_size=1, max_size=6)
    return st.one_of(
        st.just({"type": "boolean"}),
        st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
        st.lists(words, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
        st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.integers(1, 3).map(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "maxItems": n}),
    )


def _schema() -> st.SearchStrategy[dict]:
    names = st.lists(st.text(alphabet="klmnopqrs", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)
    return names.flatmap(lambda keys: st.tuples(*[_property() for _ in keys]).map(
        lambda props: {"type": "object", "properties": dict(zip(keys, props, strict=True)), "required": list(keys),
                       "additionalProperties": False}))


def _generate(engine, params: list[dict], prompt: str = PROMPT) -> list[dict]:
    return engine.generate([prompt] * len(params), sampling_params=params)


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_schema(), min_size=len(SAMPLINGS), max_size=len(SAMPLINGS)))
def test_every_json_schema_output_validates(engines, schemas):
    for engine in engines:
        params = [{**sampling, "json_schema": json.dumps(schema), "max_new_tokens": 160}
                  for schema, sampling in zip(schemas, SAMPLINGS, strict=True)]
        for out, schema, p in zip(_generate(engine, params), schemas, params, strict=True):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", (out, p)
            jsonschema.validate(json.loads(out["text"]), schema)


def test_a_schema_given_as_a_dict_and_n_choices(engines):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 3}},
              "required": ["city", "rank"]}
    for engine in engines:
        outs = engine.generate(PROMPT, sampling_params={"json_schema": schema, "n": 3, "temperature": 1.0,
                                                        "seed": 1, "max_new_tokens": 60})
        assert len(outs) == 3
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_outputs_full_match(engines):
    pattern = r"(yes|no), [0-9]{3}-[a-z]{2,4}\."
    for engine in engines:
        params = [{**sampling, "regex": pattern, "max_new_tokens": 40} for sampling in SAMPLINGS]
        for out in _generate(engine, params, "Is it raining? Answer then give a code."):
            assert re.fullmatch(pattern, out["text"]), out["text"]


def test_ebnf_outputs_match_the_grammar(engines):
    grammar = 'root ::= "The answer is " number "."\nnumber ::= [1-9] [0-9]*'
    for engine in engines:
        params = [{**sampling, "ebnf": grammar, "max_new_tokens": 30} for sampling in SAMPLINGS[:3]]
        for out in _generate(engine, params, "What is six times seven?"):
            assert re.fullmatch(r"The answer is [1-9][0-9]*\.", out["text"]), out["text"]


def _literal(text: str) -> str:
    """`text` as a regex that matches it literally (only the metacharacters escaped, newlines as \\n)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in ".^$*+?()[]{}|\\/-" else c for c in text)


def test_a_permissive_grammar_leaves_greedy_tokens_unchanged(engines):
    """The unconstrained greedy text, then a regex that allows it and anything after: the same tokens, so the
    mask lands on the right rows and allows what it should (in a batch beside a constrained request)."""
    for engine in engines:
        ids = engine.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}])
        free = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12})
        assert free["meta_info"]["finish_reason"]["type"] == "length"  # twelve text tokens, no special one
        constrained, other = engine.generate(
            input_ids=[ids, ids], sampling_params=[
                {"temperature": 0, "max_new_tokens": 12, "regex": _literal(free["text"]) + r"[\s\S]*"},
                {"temperature": 0, "max_new_tokens": 40, "json_schema": '{"type": "object"}'}])
        assert constrained["output_ids"] == free["output_ids"]
        assert other["text"].startswith("{")


def test_a_grammar_that_cannot_finish_ends_with_length_and_partial_text(engines):
    for engine in engines:
        out = engine.generate(PROMPT, sampling_params={"regex": "a{100}", "max_new_tokens": 5, "temperature": 0})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert re.fullmatch("a+", out["text"]) and len(out["text"]) <= 100


@pytest.mark.parametrize(("field", "value", "message"), [
    ("json_schema", "{not json", "is not valid JSON"),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "frobnicate"}}}', "json_schema"),
    ("regex", "(unclosed", "regex"),
    ("ebnf", "root ::= missing_rule", "ebnf"),
])
def test_a_bad_grammar_ends_with_400_naming_the_field(engines, field, value, message):
    for engine in engines:
        out = engine.generate(PROMPT, sampling_params={field: value, "max_new_tokens": 8})
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400 and out["output_ids"] == []
        assert reason["message"].startswith(f"invalid grammar: {field}: ") and message in reason["message"]
        # the scheduler goes on serving others
        after = engine.generate(PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert after["meta_info"]["completion_tokens"] == 3


def test_grammar_parameters_are_checked_before_sending():
    with pytest.raises(SamplingParamsError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams(json_schema='{"type": "object"}', regex="a+")
    with pytest.raises(SamplingParamsError, match="regex must be a non-empty string"):
        SamplingParams(regex="")
    with pytest.raises(SamplingParamsError, match="ebnf must be a non-empty string"):
        SamplingParams(ebnf=12)
    assert SamplingParams(json_schema={"type": "object"}).json_schema == '{"type": "object"}'


def test_one_schema_compiles_once_for_many_requests(engines):
    engine = engines[0]
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 5}},
                         "required": ["x"]})
    outs = _generate(engine, [{"json_schema": schema, "max_new_tokens": 30, "temperature": 0.8, "seed": i}
                              for i in range(6)])
    assert all(0 <= json.loads(o["text"])["x"] <= 5 for o in outs)
    backend = engine.scheduler.grammars.backend
    from radixserve.constrained.grammar_backend import GrammarSpec

    assert backend.submit(GrammarSpec("json_schema", schema)).done()  # the cached compile, not a new one


def test_logprobs_under_a_grammar_are_finite_json_numbers(engines):
    """The logprobs are the constrained distribution's: sampled tokens are finite, forbidden alternatives
    -9999.0 (OpenAI's stand-in for -inf), never -inf or NaN."""
    import math

    for engine in engines:
        out = engine.generate(PROMPT, sampling_params={"regex": "(yes|no)!", "max_new_tokens": 8, "temperature": 0},
                              return_logprob=True, top_logprobs_num=5)
        chosen = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert all(math.isfinite(v) and v > -9999.0 for v in chosen)
        tops = [lp for position in out["meta_info"]["output_top_logprobs"] for lp, _, _ in position]
        assert all(math.isfinite(v) for v in tops) and -9999.0 in tops  # a few tokens only are allowed there


@pytest.mark.long  # NOTE: ~35 s; the default feature soak runs grammars with retraction
def test_grammars_follow_their_requests_through_retraction_and_abort(engines, monkeypatch):
    """One request retracted every 2 decode steps (re-prefilled with the outputs it made, in chunks of 16): the
    matcher has accepted exactly the tokens the request keeps, so greedy outputs equal an undisturbed run's and
    validate, with jump-forward's tokens extended or fed through decode steps; aborting a request that runs
    under a grammar loses nothing."""
    from radixserve import Engine

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    params = [{"json_schema": schema, "max_new_tokens": 60, "temperature": 0}] * 3 + \
             [{"regex": "[a-z]{3,9}( [a-z]{3,9}){2}", "max_new_tokens": 30, "temperature": 0}] * 3
    prompts = [f"Item {i}: describe it briefly." for i in range(len(params))]
    calm = [o["output_ids"] for o in engines[1].generate(prompts, sampling_params=params)]
    monkeypatch.setenv("RADIXSERVE_TEST_RETRACT_INTERVAL", "2")
    import radixserve.constrained.jump_forward as jump_forward

    for overlap, fed in ((True, False), (False, False), (True, True), (False, True)):
        # NOTE: fed: every jump-forward's tokens go through decode steps, retracted on the way too
        monkeypatch.setattr(jump_forward, "EXTEND_ALWAYS_TOKENS", 10**6 if fed else 1)
        engine = Engine(dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, log_level="warning",
                        disable_overlap_schedule=not overlap)
        try:
            outs = engine.generate(prompts, sampling_params=params)
            assert engine.scheduler.stats.num_retractions >= 2
            assert [o["output_ids"] for o in outs] == calm, (overlap, fed)
            for out in outs[:3]:
                jsonschema.validate(json.loads(out["text"]), schema)
            stream = engine.generate(PROMPT, sampling_params={"json_schema": schema, "max_new_tokens": 60},
                                     stream=True)
            next(stream)
            stream.close()  # NOTE: aborts the running request
            for _ in range(200):
                state = engine.get_internal_state()
                if state["num_running_reqs"] == 0 and state["kv_conservation"] is not None:
                    break
                time.sleep(0.05)
            assert "error" not in state["kv_conservation"] and state["num_running_reqs"] == 0
        finally:
            engine.shutdown()


def test_a_compiling_grammar_holds_up_no_one_and_times_out_with_400(engines, monkeypatch):
    """While one grammar compiles (made slow here) an unconstrained request runs to the end; past
    --grammar-compile-timeout the waiting request ends with a 400 and nothing leaks."""
    import threading

    engine = engines[0]
    grammars = engine.scheduler.grammars
    backend = grammars.backend
    release = threading.Event()
    compile_real = backend._compile

    def slow(spec):
        if spec.source == "slow+":
            release.wait(10)
        return compile_real(spec)

    monkeypatch.setattr(backend, "_compile", slow)
    monkeypatch.setattr(grammars, "compile_timeout_s", 3.0)
    results = {}
    waiting = threading.Thread(target=lambda: results.setdefault(
        "slow", engine.generate(PROMPT, sampling_params={"regex": "slow+", "max_new_tokens": 4})))
    waiting.start()
    for _ in range(200):
        if grammars.compiling:
            break
        time.sleep(0.01)
    assert grammars.compiling  # the constrained request waits for its grammar now
    free = engine.generate(PROMPT, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    assert free["meta_info"]["completion_tokens"] == 8 and "slow" not in results  # it did not wait for the grammar
    waiting.join(20)
    release.set()
    reason = results["slow"]["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "did not compile within 3 s" in reason["message"]


@pytest.mark.parametrize("vocab", [49152, 49150, 33])
def test_our_bitmask_application_equals_xgrammars(vocab):
    import torch
    import xgrammar as xgr

    from radixserve.constrained.grammar_backend import apply_token_bitmask

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # a row with every token allowed
    bitmask[2, 3:] = 0  # a row with few allowed
    logits = torch.randn(5, vocab, generator=g)
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want) and torch.equal(got[1], logits[1])


ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}


def test_a_structural_tag_lets_text_run_until_its_trigger_then_holds_the_tagged_schema(engines):
    """xgrammar's format with `at_least_one`: free text, then `<answer>` + JSON matching the schema +
    `</answer>`; SGLang's older `structures` + `triggers` form is accepted too (the model may never trigger it,
    so each tagged part it wrote is checked)."""
    triggered = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<answer>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": ANSWER},
                  "end": "</answer>"}]}}
    legacy = {"structures": [{"begin": "<answer>", "schema": ANSWER, "end": "</answer>"}], "triggers": ["<answer>"]}
    for engine in engines:
        out = engine.generate("Which city is the capital of France?",
                              sampling_params={"structural_tag": triggered, "max_new_tokens": 60, "temperature": 0})
        tagged = re.fullmatch(r"(?s)(.*?)<answer>(.*?)</answer>", out["text"])
        assert tagged is not None, out["text"]
        jsonschema.validate(json.loads(tagged.group(2)), ANSWER)
        out = engine.generate("Which city is the capital of France?",
                              sampling_params={"structural_tag": legacy, "max_new_tokens": 30, "temperature": 0})
        for part in re.findall(r"<answer>(.*?)</answer>", out["text"], flags=re.S):
            jsonschema.validate(json.loads(part), ANSWER)
        bad = engine.generate(PROMPT, sampling_params={"structural_tag": {"type": "structural_tag", "format": 3}})
        reason = bad["meta_info"]["finish_reason"]
        assert reason["status_code"] == 400 and reason["message"].startswith("invalid grammar: structural_tag: ")


LONG_KEYS = {"type": "object", "additionalProperties": False, "properties": {
    "customer_full_name_as_written_on_the_invoice": {"type": "string", "maxLength": 12},
    "customer_billing_address_country_code": {"enum": ["FR", "IT"]},
    "total_amount_including_all_taxes_in_euros": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["customer_full_name_as_written_on_the_invoice", "customer_billing_address_country_code",
                 "total_amount_including_all_taxes_in_euros"]}


def test_jump_forward_appends_the_forced_text_without_decode_steps(engines):
    """A schema with long keys: the keys and punctuation come from jump-forward (one extend per jump instead of a
    decode step per token), the outputs still validate, logprobs stay one per token, a stream spells the same
    text, max_new_tokens holds; with jump-forward off, every token is a decode step."""
    params = [{"json_schema": LONG_KEYS, "max_new_tokens": 120, "temperature": t, "seed": 9} for t in (0, 0.9)]
    for engine in engines:
        jump, stats = engine.scheduler.output.jump_forward, engine.scheduler.stats
        assert jump.enabled  # on by default
        counted = {}
        for enabled in (False, True):
            jump.enabled = enabled
            before, steps = stats.jump_forward_tokens, stats.num_decode_batches
            outs = engine.generate(["Write an invoice as JSON."] * 2, sampling_params=params, return_logprob=True,
                                   top_logprobs_num=2)
            for out in outs:
                jsonschema.validate(json.loads(out["text"]), LONG_KEYS)
                meta = out["meta_info"]
                assert meta["finish_reason"]["type"] == "stop"
                assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == \
                    meta["completion_tokens"]
            counted[enabled] = (stats.jump_forward_tokens - before, stats.num_decode_batches - steps)
        (off_jumped, off_steps), (on_jumped, on_steps) = counted[False], counted[True]
        assert off_jumped == 0 and on_jumped >= 40 and on_steps < off_steps / 2, counted
        streamed = "".join(piece["text"] for piece in engine.generate("Write an invoice as JSON.", stream=True,
                                                                       sampling_params=params[0]))
        whole = engine.generate("Write an invoice as JSON.", sampling_params=params[0])
        assert streamed == whole["text"]
        short = engine.generate("Write an invoice as JSON.", sampling_params={**params[0], "max_new_tokens": 12})
        assert short["meta_info"]["completion_tokens"] == 12 and short["meta_info"]["finish_reason"]["type"] == "length"


def test_sampling_first_and_masking_every_row_give_the_same_greedy_tokens(engines, monkeypatch):
    """Greedy rows are sampled first and masked only when refused (constrained/batch_mask.py): the tokens equal
    those of masking every row first, in both loops; the counters show which path each row took, and a row
    that returns logprobs is always masked first."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = [{"json_schema": json.dumps(schema), "temperature": 0, "max_new_tokens": 40}] * 3
    prompts = [PROMPT, "Give me a JSON person.", "Who are you? Answer in JSON."]
    for engine in engines:
        stats = engine.scheduler.stats
        outs = {}
        for mask_all in ("1", "0"):
            monkeypatch.setenv("RADIXSERVE_GRAMMAR_MASK_ALL", mask_all)
            before = (stats.grammar_rows_masked, stats.grammar_rows_checked, stats.grammar_rows_refused)
            outs[mask_all] = [o["output_ids"] for o in engine.generate(prompts, sampling_params=params)]
            moved = [now - then for now, then in zip((stats.grammar_rows_masked, stats.grammar_rows_checked,
                                                      stats.grammar_rows_refused), before, strict=True)]
            if mask_all == "1":
                assert moved[0] > 0 and moved[1] == 0, moved
            else:
                assert moved[0] == 0 and moved[1] > 0 and 0 < moved[2] < moved[1], moved
        assert outs["0"] == outs["1"]
        monkeypatch.delenv("RADIXSERVE_GRAMMAR_MASK_ALL")
        masked = stats.grammar_rows_masked
        engine.generate(PROMPT, sampling_params=params[0], return_logprob=True)
        assert stats.grammar_rows_masked > masked


@pytest.mark.long  # NOTE: ~20 s; jump-forward's default test checks the forced text
def test_forced_tokens_fed_through_decode_steps_equal_one_extend(engines, monkeypatch):
    """Jump-forward's forced tokens are computed by one extend (small batches) or fed one per decode step
    (jump_forward.extends: large batches): the same tokens and logprobs (greedy, seeded, and a frequency
    penalty whose history must hold the forced tokens and never a dropped sample); feeding takes no prefill
    step for them, and the outputs validate."""
    import radixserve.constrained.jump_forward as jump_forward

    params = [{"json_schema": LONG_KEYS, "max_new_tokens": 90, "temperature": t, "seed": 9, "frequency_penalty": f}
              for t, f in ((0, 0.0), (0.9, 0.0), (0, 1.5), (0.8, 0.8))]
    prompts = ["Write an invoice as JSON.", "Invoice for Ada, please (JSON).", "JSON invoice:", "An invoice."]
    for engine in engines:
        stats = engine.scheduler.stats
        seen = {}
        for rows in (4, 0):  # 4: every jump extends; 0: every jump is fed through decode steps
            monkeypatch.setattr(jump_forward, "EXTEND_ALWAYS_TOKENS", 1 if rows else 10**6)
            monkeypatch.setattr(jump_forward, "EXTEND_MAX_BATCH", rows)
            prefills, jumped = stats.num_prefill_batches, stats.jump_forward_tokens
            outs = engine.generate(prompts, sampling_params=params, return_logprob=True)
            for out in outs:
                jsonschema.validate(json.loads(out["text"]), LONG_KEYS)
                assert len(out["meta_info"]["output_token_logprobs"]) == out["meta_info"]["completion_tokens"]
            seen[rows] = ([o["output_ids"] for o in outs],
                          [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs],
                          stats.num_prefill_batches - prefills, stats.jump_forward_tokens - jumped)
        (ids_x, lps_x, prefills_x, jumped_x), (ids_f, lps_f, prefills_f, jumped_f) = seen[4], seen[0]
        assert ids_x == ids_f
        for x, f in zip(lps_x, lps_f, strict=True):  # NOTE: one extend and single-token decodes round differently
            assert x == pytest.approx(f, abs=2e-3)
        assert jumped_x == jumped_f >= 100
        assert prefills_f <= len(prompts) < prefills_x, (prefills_f, prefills_x)
