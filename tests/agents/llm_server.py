"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions protocol, replaying scripted replies.

The real `openai` client talks to it over a socket; this stands in for vLLM/SGLang/Ollama, which cannot run
here. Each scripted reply is a dict: {"content": text} (a completion), {"status": code} (an error body), or
{"sleep": seconds, ...} (answer late). Requests are recorded; `on_request` lets a test act mid-run.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedLLM:
    def __init__(self):
        self.replies: list[dict] = []
        self.requests: list[dict] = []
        self.on_request = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def script(self, *replies: dict) -> None:
        self.replies = list(replies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next(self, body: dict) -> dict:
        self.requests.append(body)
        if self.on_request is not None:
            self.on_request(body)
        return self.replies.pop(0) if self.replies else {"status": 500}

    def _handler(self):
        llm = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = llm._next(body)
                time.sleep(reply.get("sleep", 0))
                if "status" in reply:
                    payload = {"error": {"message": "scripted error", "type": "server_error"}}
                    return self._send(reply["status"], payload)
                self._send(200, completion(reply["content"], body.get("model", "scripted")))

            def _send(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout) before the late answer

        return Handler


def completion(content: str, model: str) -> dict:
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


def answer(expression: str, rationale: str = "scripted") -> dict:
    """A CandidateAnswer filling the activation template."""
    return {"content": json.dumps({"template": "activation", "expression": expression, "constants": [], "code": None,
                                   "rationale": rationale})}
