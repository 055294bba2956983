"""The MoE router's and experts' backend: the torch forms, the Triton kernels, or those with the Gluon experts GEMMs on
Hopper (runtime/ops/common/backend.py: how the choice is made, logged and forced)."""
from runtime.ops.common.backend import Selector

SELECTOR = Selector(__name__, ("torch", "triton", "hopper"))
