"""The RMSNorms' backend: the torch forms or the Triton kernels (runtime/ops/common/backend.py: how the choice is made,
logged and forced)."""
from runtime.ops.common.backend import Selector

SELECTOR = Selector(__name__, ("torch", "triton"))
