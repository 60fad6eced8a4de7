"""The served OpenAPI schema under schemathesis: generated bodies, valid and invalid, against every operation.
No answer is a 5xx, every status, content type, body and header is the one the schema documents, and the
scheduler keeps serving with KV conserved after each case.

Long (`-m long`): .ci/run runs it after the default run. Skips, saying why, where schemathesis is absent."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    return shared_server(*API_SERVER_ARGS)


@pytest.fixture(scope="module")
def api_schema(server: ServerHandle):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    # NOTE: valid bodies and invalid ones (each field of the wrong type or out of the schema)
    schema.config.generation.update(modes=list(schemathesis.GenerationMode))
    return schema


def _bounded(body: object) -> None:
    """Unset or large, max_tokens means up to the whole context (seconds each): at most 3 here."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if not isinstance(body.get(name), int) or body[name] > 3:
            body[name] = 2
    params = body.get("sampling_params")
    if isinstance(params, dict) and (not isinstance(params.get("max_new_tokens"), int)
                                     or params["max_new_tokens"] > 3):
        params["max_new_tokens"] = 2


def _schemathesis_test():
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.pytest.from_fixture("api_schema")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance]

    @schema.parametrize()
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    def test_the_served_schema_holds_under_schemathesis(case, server: ServerHandle) -> None:
        _bounded(case.body)
        case.call_and_validate(checks=checks, timeout=120)
        ok = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        check_idle_conservation(server)

    return test_the_served_schema_holds_under_schemathesis


test_the_served_schema_holds_under_schemathesis = _schemathesis_test()
