"""Expert load balancing in training: the auxiliary load-balancing loss and the loss-free correction-bias update.

Aux loss, the Switch/GShard form as transformers' load_balancing_loss_func computes it for the families whose
config has router_aux_loss_coef: with the MoE layers pooled, f_e = (token, choice) pairs routed to expert e over
tokens x layers, P_e = mean over tokens x layers of softmax(router logits)_e, aux = E * sum_e f_e * P_e (k when
perfectly even). f is a constant; gradients flow through P. Both means are over one micro-batch of every rank
(global counts), and each rank's loss carries its own tokens' share of P, so the gradients FSDP sums over ranks
equal one process's on the same tokens. Counts are of the experts the tokens were actually sent to.
Correction bias (DeepSeek-V3's auxiliary-loss-free balancing): after each optimizer step every router's
correction_bias += rate * sign(mean load - load_e), the loads being the step's counts summed over ranks (every
rank applies the same update to its whole copy). The bias is a frozen fp32 buffer, saved in checkpoints.
Shape legend: E experts, L MoE layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from runtime.train.metrics import moe_layers


def track_router_probs(model: nn.Module, on: bool) -> None:
    """Make every router keep its softmax sum per forward (the aux loss reads it)."""
    for moe in moe_layers(model).values():
        moe.router.keep_prob_sum = on


def global_counts(counts: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """counts_LE: this rank's per-layer expert counts summed over ranks (int64, on the CPU)."""
    counts_LE = torch.stack([counts[i] for i in sorted(counts)]).to(device)
    if dist.is_initialized():
        dist.all_reduce(counts_LE)
    return counts_LE.cpu()


def aux_loss_share(model: nn.Module, counts_LE: torch.Tensor) -> torch.Tensor:
    """This rank's part of the micro-batch's aux loss (the parts sum over ranks to the whole); counts_LE are the
    global counts of the last forward's MoE layers in layer order."""
    routers = [moe.router for _, moe in sorted(moe_layers(model).items())]
    if len({r.weight.shape[0] for r in routers}) != 1:
        raise ValueError("the auxiliary load-balancing loss pools the MoE layers: they must have equal expert counts")
    num_experts, num_layers = counts_LE.shape[1], counts_LE.shape[0]
    # every token makes top_k choices in every layer: the global token count from the counts themselves
    num_tokens = counts_LE[0].sum() / routers[0].top_k
    prob_sum_E = sum(r.last_prob_sum for r in routers)
    f_E = counts_LE.sum(0).to(prob_sum_E.device, torch.float32) / (num_layers * num_tokens)
    return num_experts * (f_E * prob_sum_E).sum() / (num_layers * num_tokens)


def keep_bias_fp32(model: nn.Module) -> None:
    """Correction biases in fp32: an update of 1e-3 is below bf16's resolution at the biases' magnitudes."""
    for moe in moe_layers(model).values():
        if moe.router.correction_bias is not None:
            moe.router.correction_bias = moe.router.correction_bias.float()


@torch.no_grad()
def update_correction_bias(model: nn.Module, load: dict[int, torch.Tensor], rate: float) -> None:
    """bias_e += rate * sign(mean load - load_e) in every MoE layer with a correction bias (load: layer -> [E])."""
    for i, moe in moe_layers(model).items():
        bias_E = moe.router.correction_bias
        if bias_E is not None:
            load_E = load[i].to(bias_E.device, torch.float32)
            bias_E += rate * torch.sign(load_E.mean() - load_E)


def bias_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime buffer name -> correction bias, for the layers that have one."""
    return {f"layers.{i}.ffn.router.correction_bias": b for i, b in correction_biases(model).items()}


def correction_biases(model: nn.Module) -> dict[int, torch.Tensor]:
    """layer -> its router's correction bias, for the layers that have one."""
    return {i: moe.router.correction_bias for i, moe in moe_layers(model).items()
            if moe.router.correction_bias is not None}
