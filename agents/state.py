"""The graph's state: a TypedDict of pydantic values (LangGraph validates pydantic state only on node inputs
and returns plain dicts; a TypedDict keeps the values typed and checkpointable as they are)."""
from __future__ import annotations

from typing import Literal, Optional, TypedDict, Union

from pydantic import BaseModel

from onboard.align.report import Check
from onboard.gap.generated import GeneratedOp
from onboard.gap.report import GapReport
from onboard.package.derivation import OwnStep, SetStep, SpecStep
from onboard.plan.search import ParallelPlan
from runtime import defaults
from runtime.spec import ModelSpec


class RunOptions(BaseModel):
    model_dir: str
    out: str
    gpu_mem_gib: float = defaults.GPU_MEM_GIB
    lora_rank: int = defaults.LORA_RANK
    seq_len: int = defaults.SEQ_LEN
    gpus: int = defaults.GPUS  # the cluster plan.yaml is planned for
    gpus_per_node: int = defaults.GPUS_PER_NODE
    llm_url: Optional[str] = None
    llm_model: Optional[str] = None
    max_attempts: int = 3  # candidates per op before it is reported missing
    align_tiers: list[int] = [0, 1, 2]  # 3 (gloo processes) and 4 (the plan's cluster, on paper) when asked


class Failure(BaseModel):
    """Why a candidate was refused: which check, which metric, by how much, and the traceback tail."""
    check: str  # "ast", "template", "llm", "crash", "timeout", "forward", "grad:x", "tier0", ...
    metric: str = "-"
    value: Optional[float] = None
    tolerance: Optional[float] = None
    dtype: Optional[str] = None
    detail: str = ""

    @property
    def value_text(self) -> str:
        return "-" if self.value is None else f"{self.value:.3e}"


class Candidate(BaseModel):
    template: str
    source: str  # the rendered module
    rationale: str = ""


class OpTask(BaseModel):
    """One op the runtime lacks, to be closed by a generated candidate (or reported with its evidence)."""
    kind: str  # agents/op_kinds.py KINDS
    name: str  # the spec's name for it, e.g. the config's hidden_act
    closes: dict[str, list[int]]  # registry op -> layers
    reference: Optional[str]  # the model's own implementation, None when there is none to validate against
    needs: Literal["llm", "person"]
    status: Literal["pending", "accepted", "missing"] = "pending"
    attempts: int = 0
    failures: list[Failure] = []  # of the latest attempt
    history: list[list[Failure]] = []  # every attempt's failures, for the report
    candidate: Optional[Candidate] = None
    accepted: Optional[GeneratedOp] = None


class Proposal(BaseModel):
    """The LLM's structured explanation of an unrecognized config key: the op family it parameterizes and how."""
    op: str  # a registry op (runtime/registry.py OPS) it parameterizes, or "none": it changes nothing computed
    meaning: str
    parameter: Optional[str] = None  # the spec field it sets: a path inside each layer ("ffn.top_k") or from the top
    value: Optional[Union[bool, int, float, str]] = None  # the value for that field; None: the key's own value
    rationale: str = ""


class Explanation(BaseModel):
    """One unrecognized item of the gap report, and what became of explaining it."""
    source: str
    item: str
    value: Optional[Union[bool, int, float, str, list, dict]] = None  # the config key's value
    needs: Literal["llm", "person"]
    status: Literal["pending", "accepted", "refused", "open"] = "pending"
    proposal: Optional[Proposal] = None
    failures: list[Failure] = []
    evidence: dict = {}  # for an accepted proposal: the tiers that confirmed it


class Alignment(BaseModel):
    passed: bool
    summary: str
    failed_tier: Optional[int] = None  # the first tier that failed (None: passed)
    failed: list[Check] = []  # that tier's failing checks


class Demotion(BaseModel):
    """One rung of the demotion after a failed alignment (onboard/review/demotion.py): what failed, what runs as own code now."""
    rung: Literal["layers", "model"]
    failed: list[Check]  # the failing checks that called for it


class OnboardState(TypedDict, total=False):
    options: RunOptions
    spec: ModelSpec
    # what changed the spec after recognition, in order (package.yaml's spec_steps; readers derive it again)
    spec_steps: list[SpecStep]
    report: GapReport
    tasks: list[OpTask]
    explanations: list[Explanation]
    validation_salt: int  # seeds of the fuzzed validation inputs derive from it; never shown to the LLM
    plan: ParallelPlan  # plan.yaml's, of the spec as it stands (the plan node plans again after a demotion)
    package: Optional[str]
    alignment: Optional[Alignment]
    demotions: list[Demotion]  # the rungs tried, in order (at most one each)
    exit_code: int


SERIALIZED_TYPES = [RunOptions, ModelSpec, GapReport, OpTask, Alignment, GeneratedOp, Failure, Candidate, Proposal,
                    Explanation, Check, Demotion, SetStep, OwnStep, ParallelPlan]
