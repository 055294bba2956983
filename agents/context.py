"""What nodes get beside the state and is not checkpointed: the run folder, the LLM client, progress output."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from agents.llm import LLMClient


@dataclass
class Context:
    run_dir: Path  # the run's working folder beside PKG: checkpoint, LLM log, sandbox folders
    llm: Optional[LLMClient]  # None: the deterministic path (no candidates generated)
    progress: Callable[[str], None] = print
