"""DSA's backend: the torch forms, the Triton kernels, or those with the Gluon forward and dkv pass on Hopper
(runtime/ops/common/backend.py: how the choice is made, logged and forced)."""
from runtime.ops.common.backend import Selector

SELECTOR = Selector(__name__, ("torch", "triton", "hopper"))
