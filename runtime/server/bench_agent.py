"""The agent-trace dataset of `kvc bench serve` (`--dataset agent`): sessions shaped like a coding
agent's, replayed with or without kvc's chain cache.

A session is a task prompt (`--input-len` tokens) and `--num-turns` turns. Each turn appends a
long tool result (uniform in `[--tool-len-min, --tool-len-max]` tokens) and asks for a short
assistant turn (`--output-len` tokens); the next turn resends the whole conversation, answers
included. On /v1/completions everything is token ids (exact lengths); on the chat endpoint the
task is a user message, tool results are `tool` messages of random words (lengths in words).

Sessions run concurrently (`--max-concurrency` sessions at once, started at `--request-rate`
sessions per second), the turns of a session one after the other. With `--chains`, turn 1 opens
a chain (`{"chain": true}`) and turn k continues the chain turn k-1's response named
(`{"chain_id": ID}`), so the server prefills only the new suffix; a chain evicted between turns
(410) is reopened with the whole conversation, and counted. The JSON gets an `agent` section:
per session the end-to-end time, and per turn TTFT, prompt tokens and cached (not prefilled)
prompt tokens.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from kvc.runtime.server.bench import BenchConfig, RequestResult, _pause, _words


@dataclass(frozen=True)
class AgentTurn:
    tool_result: list[int] | str  # token ids (completions) or text (chat)
    max_tokens: int


@dataclass(frozen=True)
class AgentSession:
    task: list[int] | str
    turns: tuple[AgentTurn, ...]


def make_sessions(*, seed: int, num_sessions: int, num_turns: int, task_len: int, tool_len_min: int,
                  tool_len_max: int, output_len: int, vocab_size: int, chat: bool) -> list[AgentSession]:
    """The dataset: the same sessions for the same arguments (its own generator, seeded)."""
    rng = random.Random(f"kvc-agent-{seed}")

    def text(n: int) -> list[int] | str:
        return _words(rng, n) if chat else [rng.randrange(vocab_size) for _ in range(n)]

    return [
        AgentSession(task=text(task_len),
                     turns=tuple(AgentTurn(text(rng.randint(tool_len_min, tool_len_max)), output_len)
                                 for _ in range(num_turns)))
        for _ in range(num_sessions)
    ]


@dataclass
class SessionResult:
    e2e: float = 0.0  # first request sent to last response done, seconds
    turns: list[RequestResult] = field(default_factory=list)
    chains_reopened: int = 0  # turns whose chain had been evicted (410) and were resent on a new one

    def as_json(self) -> dict:
        return {
            "e2e_s": self.e2e,
            "turns_completed": sum(r.ok for r in self.turns),
            "ttft_s": [r.ttft for r in self.turns],
            "prompt_tokens": [r.prompt_tokens for r in self.turns],
            "cached_tokens": [r.cached_tokens for r in self.turns],
            "chains_reopened": self.chains_reopened,
        }


async def replay(client, session: AgentSession, chains: bool, on_turn=lambda: None) -> SessionResult:
    """Plays one session: each turn resends the conversation plus the next tool result."""
    out = SessionResult()
    history: list = list(session.task) if not client.chat else [{"role": "user", "content": session.task}]
    chain_id: str | None = None
    start = time.perf_counter()
    for turn in session.turns:
        if client.chat:
            history.append({"role": "tool", "content": turn.tool_result})
        else:
            history = history + turn.tool_result
        extra = {} if not chains else {"chain": True} if chain_id is None else {"chain_id": chain_id}
        res = await client.send(history, turn.max_tokens, extra)
        if chains and chain_id is not None and res.status == 410:  # evicted between turns: start over
            out.chains_reopened += 1
            res = await client.send(history, turn.max_tokens, {"chain": True})
        out.turns.append(res)
        on_turn()
        if not res.ok:
            break
        if chains and res.chain_id is None:
            res.ok, res.error = False, "the server did not name a chain (chain_id); does it support chains?"
            break
        chain_id = res.chain_id
        if client.chat:
            history.append({"role": "assistant", "content": res.output_text})
        else:
            history = history + res.output_ids
    out.e2e = time.perf_counter() - start
    return out


async def run_agent(cfg: BenchConfig, client, rng: random.Random, vocab: int, gate: asyncio.Semaphore,
                    results: list[RequestResult], tick) -> dict:
    """The `agent` dataset for `run_benchmark`: fills `results` (one per turn) and returns the
    `agent` section of the JSON."""
    sessions = make_sessions(seed=cfg.seed, num_sessions=cfg.num_prompts, num_turns=cfg.num_turns,
                             task_len=cfg.input_len, tool_len_min=cfg.tool_len_min, tool_len_max=cfg.tool_len_max,
                             output_len=cfg.output_len, vocab_size=vocab, chat=client.chat)
    done: list[SessionResult | None] = [None] * len(sessions)

    async def one(i: int, session: AgentSession) -> None:
        async with gate:  # a session holds its slot from its first turn to its last
            done[i] = await replay(client, session, cfg.chains, tick)
        results.extend(done[i].turns)

    tasks = []
    for i, session in enumerate(sessions):
        tasks.append(asyncio.ensure_future(one(i, session)))
        await _pause(cfg, rng)
    await asyncio.gather(*tasks)
    return summarize_sessions([s for s in done if s is not None], cfg.chains)


def summarize_sessions(sessions: list[SessionResult], chains: bool) -> dict:
    complete = [s for s in sessions if s.turns and all(r.ok for r in s.turns)]
    ok_turns = [r for s in sessions for r in s.turns if r.ok]
    prompt = sum(r.prompt_tokens for r in ok_turns)
    cached = sum(r.cached_tokens for r in ok_turns)
    num_turns = max((len(s.turns) for s in sessions), default=0)
    per_turn = [[s.turns[k] for s in sessions if len(s.turns) > k and s.turns[k].ok] for k in range(num_turns)]
    e2e = [s.e2e for s in complete]
    return {
        "chains": chains,
        "sessions_completed": len(complete),
        "mean_session_e2e_s": statistics.fmean(e2e) if e2e else 0.0,
        "median_session_e2e_s": statistics.median(e2e) if e2e else 0.0,
        "max_session_e2e_s": max(e2e, default=0.0),
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "total_prefilled_tokens": prompt - cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "chains_reopened": sum(s.chains_reopened for s in sessions),
        "per_turn": {
            "mean_ttft_ms": [statistics.fmean(r.ttft for r in rs) * 1000 if rs else 0.0 for rs in per_turn],
            "mean_prompt_tokens": [statistics.fmean(r.prompt_tokens for r in rs) if rs else 0.0 for rs in per_turn],
            "mean_cached_tokens": [statistics.fmean(r.cached_tokens for r in rs) if rs else 0.0 for rs in per_turn],
        },
        "sessions": [s.as_json() for s in sessions],
    }


def table_rows(agent: dict) -> list[tuple[str, str]]:
    """Rows for the markdown summary."""
    ttft = agent["per_turn"]["mean_ttft_ms"]
    rows = [
        ("Chains", "yes" if agent["chains"] else "no"),
        ("Sessions completed", f"{agent['sessions_completed']}"),
        ("Mean session time (s)", f"{agent['mean_session_e2e_s']:.2f}"),
        ("Max session time (s)", f"{agent['max_session_e2e_s']:.2f}"),
        ("Prompt tokens (cached)", f"{agent['total_prompt_tokens']} ({agent['total_cached_tokens']}, "
                                   f"{agent['cached_fraction']:.0%})"),
    ]
    if ttft:
        rows.append(("Mean TTFT turn 1 / last (ms)", f"{ttft[0]:.2f} / {ttft[-1]:.2f}"))
    if agent["chains_reopened"]:
        rows.append(("Chains reopened after eviction", f"{agent['chains_reopened']}"))
    return rows
