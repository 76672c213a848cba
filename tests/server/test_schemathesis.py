"""Property-based fuzzing of the server through its own OpenAPI schema (schemathesis): whatever
the schema allows, or nearly allows, the server never answers 5xx, and every response matches
the status codes, content types and bodies the schema declares. Bounded in examples and time.

Two ways: each operation as a hypothesis test (so that xdist spreads them; schemathesis' lazy
pytest loader does not work with pytest 9), and one run of schemathesis' own CLI, which adds its
coverage and stateful phases: schema-violating data must be refused (no lax coercion, no unknown
field accepted), an unsupported method must be a 405 listing every allowed one, a request without
the API key must be refused, chains are created, read and deleted in sequences.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys

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

from tests.server.conftest import live_server, served_process

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
OPERATIONS = [
    ("POST", "/v1/completions", 40),
    ("POST", "/v1/chat/completions", 40),
    ("POST", "/tokenize", 25),
    ("POST", "/detokenize", 25),
    ("GET", "/v1/models", 5),
    ("GET", "/v1/models/{model}", 10),
    ("GET", "/v1/chains", 3),
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


# every check but positive_data_acceptance: the API has rules a JSON schema does not state (one of
# prompt and messages, at most one chain field), so some schema-valid requests are rightly a 400
CLI_CHECKS_EXCLUDED = "positive_data_acceptance"


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-key"])
def test_the_schemathesis_cli_finds_nothing(tmp_path, keyed):
    """A bounded `schemathesis run` against `kvc serve` (about 15 s a server): every check passes
    and no response is a 5xx."""
    options = ["--max-model-len", "96", "--kv-cache-memory", str(8 * 2**20), "--max-waiting-requests", "64"]
    with served_process(*options, *(["--api-key", "fuzz-key"] if keyed else [])) as (_, url):
        _run_cli(url, tmp_path / "events.ndjson", keyed)


def _run_cli(url: str, events, keyed: bool) -> None:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
           "--exclude-checks", CLI_CHECKS_EXCLUDED, "--max-examples", "20",
           "--generation-deterministic", "--request-timeout", "30", "--no-color",
           "--report", "ndjson", "--report-ndjson-path", str(events)]
    if keyed:
        cmd += ["--header", "Authorization: Bearer fuzz-key"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=events.parent)
    statuses = collections.Counter()
    for line in events.read_text().splitlines():
        event = json.loads(line)
        for interaction in event.get("ScenarioFinished", {}).get("recorder", {}).get("interactions", {}).values():
            statuses[(interaction.get("response") or {}).get("status_code")] += 1
    assert run.returncode == 0, run.stdout[-6000:]
    assert sum(statuses.values()) > 500, statuses  # it really ran
    assert not {s: n for s, n in statuses.items() if s is None or s >= 500}, statuses
    if keyed:
        assert statuses[401] > 0, statuses  # ignored_auth sent requests without the key
