"""Agents fixtures: the scripted OpenAI-compatible server, and a known family asking for an op outside the registry."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.agents.llm_server import ScriptedLLM

# a proxy in the environment must not swallow requests to the local server
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def llm_server():
    server = ScriptedLLM()
    yield server
    server.close()


@pytest.fixture(scope="session")
def relu2_release(example_release, tmp_path_factory):
    """Qwen3-MoE's tiny release with hidden_act "relu2" (squared ReLU): transformers runs it (ACT2FN), the
    runtime's activation table lacks it, so its experts are a gap."""
    out = tmp_path_factory.mktemp("releases") / "qwen3_moe_relu2"
    shutil.copytree(example_release("qwen3_moe"), out)
    config = json.loads((out / "config.json").read_text())
    config["hidden_act"] = "relu2"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
