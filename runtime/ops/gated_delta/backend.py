"""GDN's and KDA's backend: the torch forms, the Triton kernels, or those with the Gluon prep, state_grad and wy_grad
on Hopper (runtime/ops/common/backend.py: how the choice is made, logged and forced)."""
from runtime.ops.common.backend import Selector

SELECTOR = Selector(__name__, ("torch", "triton", "hopper"))
