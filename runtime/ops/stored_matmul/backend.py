"""The stored-weight matmul's backend: the torch form or the Triton kernel (runtime/ops/common/backend.py: how the
choice is made, logged and forced)."""
from runtime.ops.common.backend import Selector

SELECTOR = Selector(__name__, ("torch", "triton"))
