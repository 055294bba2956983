"""The LLM client against a real local HTTP server through the real openai client: structured answers, the
JSON-in-text second try, garbage, errors and timeouts end in an answer or a clear LLMError, never a hang."""
from __future__ import annotations

import json
import time

import pytest

from agents.candidates import CandidateAnswer
from agents.llm import LLMClient, LLMError
from tests.agents.llm_server import answer


def _client(server, tmp_path, **kw) -> LLMClient:
    return LLMClient(server.url, "scripted-model", tmp_path / "llm.jsonl", backoff_s=0.05, **kw)


def test_a_structured_answer_is_parsed_and_logged_with_its_usage(llm_server, tmp_path):
    llm_server.script(answer("torch.relu(x) ** 2"))
    client = _client(llm_server, tmp_path)
    got = client.ask("write relu2", CandidateAnswer, "test")
    assert got.expression == "torch.relu(x) ** 2"
    sent = llm_server.requests[0]
    assert sent["response_format"]["type"] == "json_schema" and sent["model"] == "scripted-model"
    log = [json.loads(line) for line in (tmp_path / "llm.jsonl").read_text().splitlines()]
    assert log[0]["messages"][0]["content"] == "write relu2" and log[0]["usage"]["total_tokens"] == 18
    assert client.usage == {"prompt_tokens": 11, "completion_tokens": 7}


def test_a_server_without_structured_outputs_gets_the_schema_in_the_prompt(llm_server, tmp_path):
    fenced = "<think>hmm</think>Here:\n```json\n" + answer("x * torch.sigmoid(x)")["content"] + "\n```"
    llm_server.script({"status": 400}, {"content": fenced})
    got = _client(llm_server, tmp_path).ask("write silu", CandidateAnswer, "test")
    assert got.expression == "x * torch.sigmoid(x)"
    assert "response_format" not in llm_server.requests[1]
    assert "JSON schema" in llm_server.requests[1]["messages"][0]["content"]


def test_garbage_is_re_asked_with_the_error_a_bounded_number_of_times(llm_server, tmp_path):
    llm_server.script(*[{"content": "I would rather not."}] * 5)
    with pytest.raises(LLMError, match="no answer matching CandidateAnswer after 3 tries"):
        _client(llm_server, tmp_path).ask("write relu2", CandidateAnswer, "test")
    # one structured try, then three text tries, each re-ask carrying the rejection
    assert len(llm_server.requests) == 4
    assert "rejected" in llm_server.requests[-1]["messages"][-1]["content"]


def test_server_errors_are_retried_with_backoff_then_answered(llm_server, tmp_path):
    llm_server.script({"status": 503}, {"status": 500}, answer("torch.relu(x) ** 2"))
    assert _client(llm_server, tmp_path).ask("x", CandidateAnswer, "test").expression == "torch.relu(x) ** 2"
    assert len(llm_server.requests) == 3


def test_an_endpoint_that_times_out_gives_a_clear_error_in_bounded_time(llm_server, tmp_path):
    llm_server.script(*[{"sleep": 3, **answer("x")}] * 3)
    start = time.monotonic()
    with pytest.raises(LLMError, match="APITimeoutError after 2 attempts"):
        _client(llm_server, tmp_path, timeout_s=0.5, attempts=2).ask("x", CandidateAnswer, "test")
    assert time.monotonic() - start < 5


def test_no_server_at_all_is_a_clear_error(tmp_path):
    client = LLMClient("http://127.0.0.1:9/v1", "m", tmp_path / "llm.jsonl", timeout_s=1, attempts=2, backoff_s=0.05)
    with pytest.raises(LLMError, match="APIConnectionError"):
        client.ask("x", CandidateAnswer, "test")
