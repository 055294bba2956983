"""`onboard example-model kimi_k3`: a tiny custom-code release of Kimi K3's shape.

config.json with K3's keys (config.py) and an `auto_map` naming the release's own files, which are copied beside
the weights (release_code/); weights written by those files' model class in a subprocess (build.py); the example
tokenizer. `weights="mxfp4"` stores the routed experts as compressed-tensors MXFP4, as K3 ships them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onboard
from onboard.errors import BadInput
from onboard.examples.kimi_k3.config import AUTO_MAP, GENERATION_DEFAULTS
from onboard.examples.tokenizer import write_example_tokenizer

CODE_DIR = Path(__file__).resolve().parent / "release_code"
CODE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py")
WEIGHT_FORMATS = ("bf16", "mxfp4")


def write_kimi_k3_release(out_dir: Path, num_shards: int = 1, seed: int = 0, weights: str = "bf16") -> Path:
    out_dir = Path(out_dir)
    if weights not in WEIGHT_FORMATS:
        raise BadInput(None, "--weights", f"expected one of {', '.join(WEIGHT_FORMATS)} for kimi_k3, got {weights!r}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BadInput(out_dir, None, "output folder exists and is not empty")
    _build_in_subprocess(out_dir, seed, num_shards, weights)
    for name in CODE_FILES:
        shutil.copyfile(CODE_DIR / name, out_dir / name)
    _finish_config(out_dir / "config.json")
    write_example_tokenizer(out_dir)
    return out_dir


def _build_in_subprocess(out_dir: Path, seed: int, num_shards: int, weights: str) -> None:
    root = str(Path(onboard.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "onboard.examples.kimi_k3.build", str(out_dir), str(seed),
                           str(num_shards), weights], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the kimi_k3 example failed:\n{done.stderr[-3000:]}")


def _finish_config(path: Path) -> None:
    """auto_map naming the shipped files; the text config's sampling keys as a transformers 4 save wrote them."""
    config = json.loads(path.read_text())
    config["auto_map"] = AUTO_MAP
    config["text_config"] = {**config["text_config"], **GENERATION_DEFAULTS}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
