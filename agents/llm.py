"""An OpenAI-compatible chat endpoint (vLLM, SGLang, Ollama, a hosted API) asked for structured answers.

Structured outputs first (`response_format` json_schema through `parse`); where a server refuses them or
answers something the schema rejects, the schema goes into the prompt and the first JSON object of the
text is validated, re-asking with the validation error a bounded number of times. Transport failures
(timeouts, connection errors, 429, 5xx) are retried with exponential backoff by this client alone
(the openai package's own retries are off), so a call takes at most about attempts x timeout.
Every request, answer, error and token count is appended to a JSONL log in the run folder.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import TypeVar

import openai
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)
TRANSIENT = (openai.APITimeoutError, openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)
# a server without structured outputs refuses the request or answers text the schema rejects (parse raises
# ValidationError on non-JSON text and TypeError on a body without choices)
NOT_STRUCTURED = (openai.BadRequestError, openai.UnprocessableEntityError, openai.LengthFinishReasonError,
                  openai.ContentFilterFinishReasonError, ValidationError, ValueError, TypeError)
THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


class LLMError(RuntimeError):
    """The endpoint gave no usable answer within the bounded retries; the message says why."""


class LLMClient:
    def __init__(self, url: str, model: str, log_path: Path, timeout_s: float = 120.0, attempts: int = 3,
                 backoff_s: float = 1.0):
        self.url, self.model, self.log_path = url, model, Path(log_path)
        self.attempts, self.backoff_s = attempts, backoff_s
        self.client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY") or "not-needed",
                                    timeout=timeout_s, max_retries=0)
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def ask(self, prompt: str, schema: type[T], purpose: str) -> T:
        """One structured answer; LLMError when the endpoint cannot give one."""
        messages = [{"role": "user", "content": prompt}]
        try:
            parsed = self._structured(messages, schema, purpose)
        except NOT_STRUCTURED as err:
            self._log(purpose, "structured", messages, None, f"{type(err).__name__}: {str(err)[:500]}")
            parsed = None
        return parsed if parsed is not None else self._from_text(messages, schema, purpose)

    def _structured(self, messages: list[dict], schema: type[T], purpose: str) -> T | None:
        completion = self._call(lambda: self.client.chat.completions.parse(
            model=self.model, messages=messages, response_format=schema), purpose, "structured", messages)
        return completion.choices[0].message.parsed if completion.choices else None

    def _from_text(self, messages: list[dict], schema: type[T], purpose: str) -> T:
        """JSON-in-text: the schema in the prompt, re-asked with the validation error, bounded."""
        prompt = (f"{messages[0]['content']}\n\nAnswer with only one JSON object matching this JSON schema:\n"
                  f"{json.dumps(schema.model_json_schema())}")
        messages = [{"role": "user", "content": prompt}]
        error = "no attempt"
        for _ in range(self.attempts):
            completion = self._call(lambda: self.client.chat.completions.create(model=self.model, messages=messages),
                                    purpose, "text", messages)
            text = (completion.choices[0].message.content or "") if completion.choices else ""
            try:
                return schema.model_validate_json(first_json_object(text))
            except (ValidationError, ValueError) as err:
                error = f"{type(err).__name__}: {str(err)[:500]}"
                messages = messages + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": f"That answer was rejected: {error}. Answer again."}]
        raise LLMError(f"{self.url}: no answer matching {schema.__name__} after {self.attempts} tries ({error})")

    def _call(self, request, purpose: str, mode: str, messages: list[dict]):
        for attempt in range(1, self.attempts + 1):
            try:
                completion = request()
            except TRANSIENT as err:
                self._log(purpose, mode, messages, None, f"{type(err).__name__}: {err}")
                if attempt == self.attempts:
                    raise LLMError(f"{self.url}: {type(err).__name__} after {attempt} attempts ({err})") from None
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
                continue
            except openai.APIStatusError as err:
                if isinstance(err, (openai.BadRequestError, openai.UnprocessableEntityError)):
                    raise
                raise LLMError(f"{self.url}: HTTP {err.status_code} ({err.message})") from None
            self._log(purpose, mode, messages, completion, None)
            return completion

    def _log(self, purpose: str, mode: str, messages: list[dict], completion, error: str | None) -> None:
        usage = getattr(completion, "usage", None)
        if usage is not None:
            self.usage["prompt_tokens"] += usage.prompt_tokens or 0
            self.usage["completion_tokens"] += usage.completion_tokens or 0
        answer = completion.choices[0].message.content if completion is not None and completion.choices else None
        entry = {"time": time.time(), "purpose": purpose, "mode": mode, "model": self.model, "messages": messages,
                 "answer": answer, "error": error, "usage": usage.model_dump() if usage is not None else None}
        with open(self.log_path, "a") as log:
            log.write(json.dumps(entry) + "\n")


def first_json_object(text: str) -> str:
    """The first balanced {...} of an answer, past code fences and <think> blocks."""
    text = THINK.sub("", text)
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in the answer")
    obj, end = json.JSONDecoder().raw_decode(text[start:])
    return json.dumps(obj)
