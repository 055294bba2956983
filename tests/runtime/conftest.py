"""Settings for the runtime tests (fixtures shared with other groups live in tests/conftest.py)."""
from __future__ import annotations

import torch

# Tiny shapes on a shared 2-core machine: a second intra-op thread only spins (a 32x64 bf16 linear took
# 1.3 ms on two threads and 0.6 ms on one; in fp32, 10 ms on two and 34 us on one, under load).
torch.set_num_threads(1)
