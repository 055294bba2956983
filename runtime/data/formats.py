"""Each data row as a Sample of one format, detected from its keys or forced (`--data-format`).

    text               {"text": str}                                       every token trained
    chat               {"messages": [{"role", "content", "tool_calls"?}], "tools"?: [...]}
                                                                            the assistant turns trained
    sharegpt           {"conversations": [{"from", "value"}], "tools"?}    as chat (from: human/user, gpt/assistant,
                                                                            system, function_call, observation/tool)
    alpaca             {"instruction", "input"?, "output", "system"?}     the output trained
    prompt-completion  {"prompt", "completion"}: strings, or lists of messages; the completion trained

Extra keys are ignored (tables often carry ids and sources). A row that fits a structured format and also has
"text" (alpaca tables often hold the rendered prompt there) is the structured format; one fitting two
structured formats must be forced. Keys holding null count as absent (a table's missing values).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.files import Row, data_error

FORMATS = ("text", "chat", "sharegpt", "alpaca", "prompt-completion")
KEYS = {"chat": ("messages",), "sharegpt": ("conversations",), "prompt-completion": ("prompt", "completion"),
        "alpaca": ("instruction", "output"), "text": ("text",)}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool", "function_call": "assistant"}


@dataclass(frozen=True)
class Sample:
    format: str
    fields: dict  # text: text; chat, sharegpt: messages, tools; alpaca: instruction, input, output, system;
    #              prompt-completion: prompt, completion (both strings, or both message lists)
    path: Path
    where: str

    @property
    def origin(self) -> str:
        return f"{self.path}: {self.where}"


def samples(rows: list[Row], data_format: str = "auto") -> list[Sample]:
    return [sample(row, data_format) for row in rows]


def sample(row: Row, data_format: str = "auto") -> Sample:
    record = row.record
    if not isinstance(record, dict):
        raise data_error(row.path, row.where, f"expected a JSON object, got {type(record).__name__}")
    fmt = detect(row) if data_format == "auto" else data_format
    missing = [k for k in KEYS[fmt] if record.get(k) is None]
    if missing:
        raise data_error(row.path, row.where, f"--data-format {fmt}: no {' or '.join(map(repr, missing))}")
    return Sample(fmt, NORMALIZE[fmt](record, row), row.path, row.where)


def detect(row: Row) -> str:
    record = row.record
    fits = [f for f, keys in KEYS.items() if all(record.get(k) is not None for k in keys)]
    structured = [f for f in fits if f != "text"]
    if len(structured) > 1:
        raise data_error(row.path, row.where, f"fits both {structured[0]} and {structured[1]}: choose one with "
                                              "--data-format")
    if not fits:
        found = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise data_error(row.path, row.where, 'expected "text", "messages", "conversations", "instruction" and '
                                              f'"output", or "prompt" and "completion" (keys found: {found})')
    return (structured or fits)[0]


def _string(value: Any, row: Row, key: str, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise data_error(row.path, row.where, f'"{key}" must be a {"" if empty_ok else "non-empty "}string')
    return value


def _text(record: dict, row: Row) -> dict:
    return {"text": _string(record["text"], row, "text")}


def _tool_calls(calls: Any, row: Row, key: str) -> list:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise data_error(row.path, row.where, f"{key}.tool_calls must be a list of objects")
    return calls


def _message(m: Any, row: Row, key: str) -> dict:
    """A message as chat templates take it: a role, string content (absent only beside tool calls)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise data_error(row.path, row.where, f'{key} must be {{"role": str, "content": str}}')
    message = {k: v for k, v in m.items() if v is not None}
    if message.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(message["tool_calls"], row, key)
    elif not isinstance(message.get("content"), str):
        raise data_error(row.path, row.where, f'{key} must be {{"role": str, "content": str}} (or carry tool_calls)')
    return message


def _messages(value: Any, row: Row, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise data_error(row.path, row.where, f'"{key}" must be a non-empty list')
    messages = [_message(m, row, f"{key}[{i}]") for i, m in enumerate(value)]
    if not any(m["role"] == "assistant" for m in messages):
        raise data_error(row.path, row.where, f"{key} has no assistant turn to train on")
    return messages


def _tools(record: dict, row: Row) -> list | None:
    tools = record.get("tools")
    if isinstance(tools, str):
        # ShareGPT files (LLaMA-Factory's) keep the tool list as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise data_error(row.path, row.where, '"tools" must be a list of tool schemas (or that list as JSON)')
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise data_error(row.path, row.where, '"tools" must be a list of tool schemas')
    return tools or None


def _chat(record: dict, row: Row) -> dict:
    return {"messages": _messages(record["messages"], row, "messages"), "tools": _tools(record, row)}


def _sharegpt_turn(turn: Any, row: Row, key: str) -> dict:
    if isinstance(turn, dict) and "role" in turn:
        return turn
    if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
        raise data_error(row.path, row.where, f'{key} must be {{"from": str, "value": str}}')
    role = SHAREGPT_ROLES.get(turn["from"].lower())
    if role is None:
        raise data_error(row.path, row.where, f'{key}: "from" {turn["from"]!r} is none of {", ".join(SHAREGPT_ROLES)}')
    if turn["from"] != "function_call":
        return {"role": role, "content": turn["value"]}
    try:
        call = json.loads(turn["value"])
    except json.JSONDecodeError:
        raise data_error(row.path, row.where, f'{key}: a function_call value must be JSON {{"name", "arguments"}}')
    return {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]}


def _sharegpt(record: dict, row: Row) -> dict:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise data_error(row.path, row.where, '"conversations" must be a non-empty list')
    messages = [_sharegpt_turn(t, row, f"conversations[{i}]") for i, t in enumerate(turns)]
    return {"messages": _messages(messages, row, "conversations"), "tools": _tools(record, row)}


def _alpaca(record: dict, row: Row) -> dict:
    return {"instruction": _string(record["instruction"], row, "instruction"),
            "input": _string(record.get("input") or "", row, "input", empty_ok=True),
            "output": _string(record["output"], row, "output"),
            "system": _string(record.get("system") or "", row, "system", empty_ok=True)}


def _prompt_completion(record: dict, row: Row) -> dict:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt_messages = [_message(m, row, f"prompt[{i}]") for i, m in enumerate(prompt)] \
            if isinstance(prompt, list) else None
        if prompt_messages is None:
            raise data_error(row.path, row.where, '"prompt" and "completion" must both be strings or both lists '
                                                  "of messages")
        return {"prompt": prompt_messages, "completion": _messages(completion, row, "completion")}
    return {"prompt": _string(prompt, row, "prompt", empty_ok=True), "completion": _string(completion, row, "completion")}


NORMALIZE = {"text": _text, "chat": _chat, "sharegpt": _sharegpt, "alpaca": _alpaca,
             "prompt-completion": _prompt_completion}
