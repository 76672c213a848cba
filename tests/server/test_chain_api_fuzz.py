"""Schemathesis over the chain-capable server (the real app over the fake chain engine): whatever
the schema allows on the generation and chain endpoints, chain fields included, never gets a 5xx
other than the declared 503s, and every response (chain_id, 404/409/410 bodies) matches the schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.test_chain_api_fake import chain_server
from tests.server.test_schemathesis import CHECKS

OPERATIONS = [
    ("POST", "/v1/completions", 20),
    ("POST", "/v1/chat/completions", 15),
    ("GET", "/v1/chains/{chain_id}", 10),
    ("DELETE", "/v1/chains/{chain_id}", 10),
]


@pytest.fixture(scope="module")
def fuzzed_chain_server():
    with chain_server(max_chains=4) as s:
        yield s


@pytest.mark.parametrize("method, path, examples", OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_chain_server_conforms_to_its_schema(fuzzed_chain_server, method, path, examples):
    operation = schemathesis.openapi.from_url(f"{fuzzed_chain_server.url}/openapi.json")[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        case.call_and_validate(base_url=fuzzed_chain_server.url, checks=CHECKS, timeout=30)

    check()
