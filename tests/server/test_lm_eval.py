"""lm-eval's `local-completions` model against `kvc serve` (a real process, the embedded default
model): a tiny multiple-choice task written here (no dataset download) scored through
/v1/completions with `echo`, `logprobs=1` and no new tokens shown, every loglikelihood equal to the
engine's own prompt logprobs of the same tokens. docs/serving.md, "Logprobs" has the command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.real_model

CAPITALS = [("France", ["Paris", "Berlin", "Madrid", "Rome"], 0), ("Germany", ["Vienna", "Berlin", "Warsaw"], 1),
            ("Italy", ["Milan", "Naples", "Rome"], 2), ("Japan", ["Tokyo", "Osaka", "Seoul"], 0)]

TASK = """task: kvc_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_task(folder) -> None:
    """The task's yaml and its jsonl data, in `folder` (lm-eval's --include_path)."""
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS))
    (folder / "kvc_capitals.yaml").write_text(TASK.format(data=data))


@pytest.fixture(scope="module")
def kvc_serve():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvc.runtime.cli", "serve", "--port", str(port),
                             "--max-model-len", "2048", "--kv-cache-memory", str(2**28)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvc serve did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_lm_eval_loglikelihood_task_against_kvc_serve(kvc_serve, tmp_path, real_model_dir):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
    from lm_eval.tasks import TaskManager

    from kvc import LLM, SamplingParams

    write_task(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=SmolLM2-135M-Instruct,base_url={kvc_serve}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={real_model_dir},num_concurrent=1,max_retries=1",
        tasks=["kvc_capitals"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    assert results["results"]["kvc_capitals"]["acc,none"] >= 0.75  # SmolLM2 knows its capitals

    llm = LLM(None, max_model_len=2048)
    samples = results["samples"]["kvc_capitals"]
    assert len(samples) == len(CAPITALS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglikelihood = resp[0][0]  # each response: [(loglikelihood, is_greedy)]
            whole, head = llm.encode(context + continuation), llm.encode(context)
            out = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
            ours = sum(e.logprob for e in out.prompt_logprobs[len(head):])
            assert loglikelihood == pytest.approx(ours, abs=1e-3), (context, continuation)
