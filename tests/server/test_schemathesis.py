"""Property-based fuzzing of the server through its own OpenAPI schema (schemathesis): whatever
the schema allows, or nearly allows, the server never answers 5xx, and every response matches
the status codes, content types and bodies the schema declares. Bounded in examples and time.

(Each operation is one test so that xdist spreads them; schemathesis' lazy pytest loader is not
used because it does not work with pytest 9.)
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import live_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
OPERATIONS = [
    ("POST", "/v1/completions", 40),
    ("POST", "/v1/chat/completions", 40),
    ("POST", "/tokenize", 25),
    ("POST", "/detokenize", 25),
    ("GET", "/v1/models", 5),
    ("GET", "/v1/models/{model}", 10),
    ("GET", "/v1/chains/{chain_id}", 10),
    ("DELETE", "/v1/chains/{chain_id}", 10),
    ("POST", "/v1/chains", 15),
    ("POST", "/v1/chains/{chain_id}/prune", 25),
    ("GET", "/health", 3),
    ("GET", "/version", 3),
    ("GET", "/metrics", 3),
]


@pytest.fixture(scope="module")
def fuzzed_server():
    # a short context bounds every generation the fuzzer can ask for
    with live_server({"max_model_len": 96}, max_waiting=64) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


def test_every_operation_is_fuzzed(fuzzed_server):
    paths = httpx.get(f"{fuzzed_server.url}/openapi.json").json()["paths"]
    ops = {(method.upper(), path) for path, methods in paths.items() for method in methods}
    assert ops == {(m, p) for m, p, _ in OPERATIONS}


@pytest.mark.parametrize("method, path, examples", OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_no_server_errors_and_responses_match_the_schema(api_schema, fuzzed_server, method, path, examples):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        case.call_and_validate(base_url=fuzzed_server.url, checks=CHECKS, timeout=30)

    check()
