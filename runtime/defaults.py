"""The workload a package is budgeted, planned and trained for when nobody says otherwise: every signature,
option model and CLI flag that defaults one of these reads it here."""
from __future__ import annotations

GPU_MEM_GIB = 80.0  # memory of one GPU: the 80 GiB data-center cards most clusters hold
GPUS = 8  # the cluster plan.yaml is planned for: one node
GPUS_PER_NODE = 8
LORA_RANK = 16
# alpha twice the rank: the LoRA scale alpha / rank is 2 whatever rank a package is written for
LORA_ALPHA_PER_RANK = 2.0
LORA_ALPHA = LORA_ALPHA_PER_RANK * LORA_RANK
SEQ_LEN = 4096  # training sequence length the activation budget and the plan are for
