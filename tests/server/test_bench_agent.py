"""`kvc bench serve --dataset agent`: the session generator (shapes, determinism by seed) and the
replay, with and without chains, against the real app over the fake chain engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvc.runtime.cli import main
from kvc.runtime.server.bench import BenchConfig, _Client
from kvc.runtime.server.bench_agent import make_sessions, replay
from tests.server.test_chain_api_fake import chain_server

SHAPE = dict(num_sessions=3, num_turns=3, task_len=16, tool_len_min=20, tool_len_max=40, output_len=4, vocab_size=301)
ARGS = ["--dataset", "agent", "--num-prompts", "3", "--num-turns", "3", "--input-len", "16", "--tool-len-min", "20",
        "--tool-len-max", "40", "--output-len", "4", "--max-concurrency", "2", "--no-progress"]


def test_sessions_have_the_asked_shape():
    sessions = make_sessions(seed=1, chat=False, **SHAPE)
    assert len(sessions) == 3 and all(len(s.turns) == 3 for s in sessions)
    for s in sessions:
        assert len(s.task) == 16 and all(0 <= t < 301 for t in s.task)
        for turn in s.turns:
            assert 20 <= len(turn.tool_result) <= 40 and turn.max_tokens == 4
            assert all(0 <= t < 301 for t in turn.tool_result)
    lengths = {len(t.tool_result) for s in sessions for t in s.turns}
    assert len(lengths) > 1  # uniform in the range, not a constant
    chat = make_sessions(seed=1, chat=True, **SHAPE)
    assert isinstance(chat[0].task, str) and len(chat[0].task.split()) == 16
    assert all(20 <= len(t.tool_result.split()) <= 40 for s in chat for t in s.turns)


def test_sessions_are_determined_by_the_seed():
    assert make_sessions(seed=3, chat=False, **SHAPE) == make_sessions(seed=3, chat=False, **SHAPE)
    assert make_sessions(seed=3, chat=False, **SHAPE) != make_sessions(seed=4, chat=False, **SHAPE)
    assert make_sessions(seed=3, chat=True, **SHAPE) == make_sessions(seed=3, chat=True, **SHAPE)


@pytest.fixture(scope="module")
def cs():
    with chain_server(max_chains=16) as s:
        yield s


def _bench(server, tmp_path, *extra):
    out = tmp_path / "agent.json"
    rc = main(["bench", "serve", "--base-url", server.url, *ARGS, "--result-file", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_replay_with_chains_prefills_only_the_new_turn(cs, tmp_path, capsys):
    opened = len(cs.fake.chains.live)
    result = _bench(cs, tmp_path, "--chains")
    agent = result["agent"]
    assert result["completed"] == 9 and result["total_output_tokens"] == 9 * 4
    assert agent["chains"] is True and agent["sessions_completed"] == 3 and agent["chains_reopened"] == 0
    assert len(cs.fake.chains.live) == opened + 3  # one chain per session, continued turn after turn
    for session, got in zip(make_sessions(seed=0, chat=False, **SHAPE), agent["sessions"]):
        tools = [len(t.tool_result) for t in session.turns]
        want_prompt = [16 + tools[0], 16 + tools[0] + 4 + tools[1], 16 + tools[0] + tools[1] + 8 + tools[2]]
        assert got["prompt_tokens"] == want_prompt
        # turn k reuses everything turn k-1 sent and received
        assert got["cached_tokens"] == [0, want_prompt[0] + 4, want_prompt[1] + 4]
        assert got["e2e_s"] >= sum(got["ttft_s"]) > 0 and got["turns_completed"] == 3
    assert agent["total_cached_tokens"] == sum(map(sum, (s["cached_tokens"] for s in agent["sessions"])))
    assert agent["total_prefilled_tokens"] == agent["total_prompt_tokens"] - agent["total_cached_tokens"]
    assert len(agent["per_turn"]["mean_ttft_ms"]) == 3 and 0 < agent["cached_fraction"] < 1
    assert result["per_request"]["cached_tokens"] and result["config"]["chains"] is True
    table = capsys.readouterr().out
    assert "| Chains | yes |" in table and "| Prompt tokens (cached) |" in table


def test_replay_without_chains_resends_everything(cs, tmp_path):
    before = cs.fake.chains.stats()
    agent = _bench(cs, tmp_path, "--seed", "7")["agent"]
    assert agent["chains"] is False and agent["sessions_completed"] == 3
    assert cs.fake.chains.stats() == before  # no chain was opened
    for session, got in zip(make_sessions(seed=7, chat=False, **SHAPE), agent["sessions"]):
        assert got["prompt_tokens"][0] == 16 + len(session.turns[0].tool_result)
        # only the prefix cache helps: whole pages, never the history's partial last page
        assert all(c % 16 == 0 and c < p for c, p in zip(got["cached_tokens"], got["prompt_tokens"]))


def test_chat_endpoint_replay_with_chains(cs, tmp_path):
    result = _bench(cs, tmp_path, "--endpoint", "/v1/chat/completions", "--chains")
    agent = result["agent"]
    assert result["failed"] == 0 and agent["sessions_completed"] == 3
    for got in agent["sessions"]:
        assert got["cached_tokens"][0] == 0 and all(c > 0 for c in got["cached_tokens"][1:])


def test_an_evicted_chain_is_reopened_with_the_whole_conversation(cs):
    session = make_sessions(seed=5, chat=False, **SHAPE)[0]

    async def play():
        async with httpx.AsyncClient(base_url=cs.url, timeout=60) as http:
            client = _Client(BenchConfig(base_url=cs.url), http, "kvc-test")
            seen: list[str] = []

            def drop_after_turn_one():
                seen.append("turn")
                if len(seen) == 1:  # the chain goes away between turns 1 and 2
                    (cid,) = [c.id for c in cs.fake.chains.live.values() if c.id not in before]
                    assert httpx.delete(f"{cs.url}/v1/chains/{cid}").status_code == 200

            return await replay(client, session, chains=True, on_turn=drop_after_turn_one)

    before = set(cs.fake.chains.live)
    out = asyncio.run(play())
    assert out.chains_reopened == 1 and all(r.ok for r in out.turns) and len(out.turns) == 3
    assert [r.cached_tokens for r in out.turns][:2] == [0, 0]  # turn 2 started a new chain from scratch
    assert out.turns[2].cached_tokens == out.turns[1].prompt_tokens + 4
    assert out.turns[1].chain_id != out.turns[0].chain_id
    assert out.turns[2].chain_id == out.turns[1].chain_id


@pytest.mark.parametrize("args, message", [
    (["--dataset", "multi-turn", "--chains"], "--chains replays the agent dataset"),
    (["--dataset", "agent", "--tool-len-min", "50", "--tool-len-max", "40"], "--tool-len-min"),
    (["--dataset", "agent", "--max-concurrency", "0"], "--max-concurrency"),
])
def test_bad_flags_are_messages(args, message, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
