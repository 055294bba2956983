"""The process group of a torchrun job: started from torchrun's environment (gloo on CPU, NCCL on GPU),
or none for one process; and the helpers the trainer's one-writer steps need."""
from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from runtime.lora.factors import is_lora_name


def start() -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); joins the job's process group when torchrun started several."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    atexit.register(_destroy)
    return dist.get_rank(), world, device


def finish() -> None:
    """The end of a run that went well, on every rank: wait for all, then leave the group, so that no rank tears its
    group down while a peer still uses it (rank 0 writing the adapter)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_without_teardown() -> NoReturn:
    """Ends a rank's process with exit code 0 once its group is destroyed and its files are closed, without the
    interpreter's teardown. A gloo worker thread releases a finished collective's work (a barrier's holds the
    all-gathers before it, FSDP2's, whose tensors Python owns) just after the rank's wait on it returns; when that
    release comes while Python is finalizing, freeing the tensors takes the GIL, the thread is made to exit, and
    std::terminate aborts the rank ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _destroy() -> None:
    # at exit after an error: no barrier, a peer may never reach it
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime name -> whole LoRA factor (gathered from the shards: a collective, every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for name, p in model.named_parameters() if is_lora_name(name)}
