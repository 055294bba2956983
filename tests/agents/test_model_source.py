"""The model's own code in prompts (onboard/release/model_source.py): the release's modeling file named by auto_map,
read as text and never executed, cut to the module's classes, capped and fenced; else transformers' classes."""
from __future__ import annotations

import inspect
import json
import shutil
import sys

import pytest

from agents.candidates import prompt
from agents.state import OpTask
from onboard.recognize.recognizer import recognize
from onboard.release import model_source
from onboard.release.manifest import read_manifest
from onboard.release.model_source import fenced, module_source

# the release's own code: running it would leave a file behind and stop the process
MODELING = '''
open(__file__ + ".ran", "w").write("executed")
raise SystemExit("the release's code must never run")


class CustomTopkRouter:
    """Scores: ```sqrt(softplus(logits))``` (backticks that would close a three-backtick fence)."""

    def forward(self, logits):
        return logits.softplus().sqrt()


class CustomMLP:
    pass
'''


@pytest.fixture
def custom_release(example_release, tmp_path):
    release = tmp_path / "release"
    shutil.copytree(example_release("qwen3_moe"), release)
    config = json.loads((release / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (release / "config.json").write_text(json.dumps(config))
    (release / "modeling_custom.py").write_text(MODELING)
    return release


def test_the_release_modeling_file_is_read_as_text_never_run(custom_release):
    source = module_source(custom_release, "qwen3_moe", "moe_router")
    assert source.origin == "release modeling_custom.py: CustomTopkRouter"
    assert source.text.startswith("class CustomTopkRouter") and "CustomMLP" not in source.text
    assert not (custom_release / "modeling_custom.py.ran").exists() and "modeling_custom" not in sys.modules
    assert source.fence == "````"  # longer than the backtick run inside


def test_a_prompt_keeps_the_release_code_inside_its_fence(custom_release):
    source = module_source(custom_release, "qwen3_moe", "moe_router")
    task = OpTask(kind="router_scoring", name="sqrtsoftplus", closes={"moe_router": [0]}, reference=None, needs="llm")
    text = prompt(task, recognize(read_manifest(custom_release)), None, source, 3)
    block = text.split("````python\n", 1)[1].split("\n````", 1)[0]
    assert block == source.text


def test_the_text_is_capped(monkeypatch):
    monkeypatch.setattr(model_source, "MAX_CHARS", 100)
    source = fenced("where", {"Big": "x = 1\n" * 100})
    assert len(source.text) < 200 and source.text.endswith("# ... cut at 100 characters\n")


def test_another_repositorys_code_is_not_looked_for_and_transformers_class_is_shown(custom_release):
    config = json.loads((custom_release / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "someone/repo--modeling_custom.CustomForCausalLM"}
    (custom_release / "config.json").write_text(json.dumps(config))
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    source = module_source(custom_release, "qwen3_moe", "moe_experts")
    assert source.origin == "transformers.models.qwen3_moe.modeling_qwen3_moe: Qwen3MoeExperts"
    assert source.text == inspect.getsource(modeling_qwen3_moe.Qwen3MoeExperts)
