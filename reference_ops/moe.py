"""fp64 reference for MoE routing and routed SwiGLU experts (the dense MLP: reference_ops/mlp.py).

Written for clarity, not speed: the experts loop over tokens and their k choices.
Every function casts its floating inputs to fp64 and is differentiable with autograd.

Shape legend: T tokens, D model width, E experts, F expert width, k top-k, r LoRA rank.
Expert weights use the nn.Linear layout per expert: w_gate_up_E2FD is [E, 2F, D] with the F gate
rows first, then the F up rows; with interleaved_gate_up the rows alternate gate, up, gate, up.
LoRA on the experts adds scale * B @ A to a weight: lora_gate_up = (A_ErD, B_E2Fr) and
lora_down = (A_ErF, B_EDr); B's rows follow the weight's row layout.
"""
from __future__ import annotations

import torch

from reference_ops.mlp import gated as _gated
from reference_ops.norms import rms_norm

# By router `scoring` name. Alignment adds the model's own function for a scoring a package generated
# (onboard/recognize/model_references.py), so the candidate is compared with it.
SCORINGS = {"softmax": lambda logits_TE: logits_TE.softmax(dim=-1), "sigmoid": torch.sigmoid}


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float64)


def _group_mask(choice_TE: torch.Tensor, num_groups: int, topk_groups: int, top2_sum: bool) -> torch.Tensor:
    """Boolean [T, E]: True for experts in the best `topk_groups` of `num_groups` groups."""
    T, E = choice_TE.shape
    grouped_TGe = choice_TE.view(T, num_groups, E // num_groups)
    if top2_sum:
        group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
    else:
        group_score_TG = grouped_TGe.max(dim=-1).values
    best_TG = group_score_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter(1, best_TG, True)
    return keep_TG.repeat_interleave(E // num_groups, dim=1)


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
    correction_bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    topk_before_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits [T, E] -> (weights_Tk fp64, idx_Tk int64), idx sorted by selection score."""
    logits_TE = logits_TE.to(torch.float64)
    if topk_before_softmax:
        # Mixtral/gpt-oss order: pick the k largest logits, then softmax over those k only.
        top_logits_Tk, idx_Tk = logits_TE.topk(top_k, dim=-1)
        return top_logits_Tk.softmax(dim=-1) * routed_scaling_factor, idx_Tk
    if scoring not in SCORINGS:
        raise ValueError(f"route: scoring must be one of {sorted(SCORINGS)}, got {scoring!r}")
    scores_TE = SCORINGS[scoring](logits_TE)
    # The correction bias steers which experts are chosen; the weights use the unbiased scores.
    choice_TE = scores_TE.detach()
    if correction_bias_E is not None:
        choice_TE = choice_TE + correction_bias_E.to(torch.float64)
    if num_groups > 1:
        top2_sum = scoring == "sigmoid" or correction_bias_E is not None
        keep_TE = _group_mask(choice_TE, num_groups, topk_groups, top2_sum)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    idx_Tk = choice_TE.topk(top_k, dim=-1).indices
    weights_Tk = scores_TE.gather(1, idx_Tk)
    if norm_topk_prob:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
    return weights_Tk * routed_scaling_factor, idx_Tk


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str, clamp: float | None, glu_alpha: float | None,
         situ_betas: tuple[float, float | None] | None = None) -> torch.Tensor:
    """The gated activation of one expert; clamp and glu_alpha give the gpt-oss form, situ_betas Kimi K3's SiTU."""
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    if glu_alpha is not None:
        return gate * torch.sigmoid(glu_alpha * gate) * (up + 1)
    return _gated(gate, up, activation, situ_betas)


def _split_gate_up(gate_up_2F: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gate_up_2F[0::2], gate_up_2F[1::2]
    return gate_up_2F.chunk(2)


def _with_lora(w_EOI: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None, scale: float) -> torch.Tensor:
    """Effective expert weight W + scale * B @ A (the clearest form of LoRA)."""
    if lora is None:
        return w_EOI
    A_ErI, B_EOr = (_f64(t) for t in lora)
    return w_EOI + scale * B_EOr @ A_ErI


def swiglu_experts(
    x_TD: torch.Tensor,
    weights_Tk: torch.Tensor,
    idx_Tk: torch.Tensor,
    w_gate_up_E2FD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    b_gate_up_E2F: torch.Tensor | None = None,
    b_down_ED: torch.Tensor | None = None,
    activation: str = "silu",
    clamp: float | None = None,
    glu_alpha: float | None = None,
    situ_betas: tuple[float, float | None] | None = None,
    interleaved_gate_up: bool = False,
    lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_down: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """Routed experts: y[t] = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]). Returns y_TD in fp64.
    activation "situ" takes situ_betas = (beta, linear_beta) (reference_ops/mlp.py situ_glu)."""
    x_TD, weights_Tk = _f64(x_TD), _f64(weights_Tk)
    w_gu_E2FD = _with_lora(_f64(w_gate_up_E2FD), lora_gate_up, lora_scale)
    w_down_EDF = _with_lora(_f64(w_down_EDF), lora_down, lora_scale)
    b_gu_E2F, b_down_ED = _f64(b_gate_up_E2F), _f64(b_down_ED)
    rows = []
    for t in range(x_TD.shape[0]):
        y_D = torch.zeros(x_TD.shape[1], dtype=torch.float64, device=x_TD.device)
        for j in range(idx_Tk.shape[1]):
            e = int(idx_Tk[t, j])
            gate_up_2F = w_gu_E2FD[e] @ x_TD[t]
            if b_gu_E2F is not None:
                gate_up_2F = gate_up_2F + b_gu_E2F[e]
            gate_F, up_F = _split_gate_up(gate_up_2F, interleaved_gate_up)
            out_D = w_down_EDF[e] @ _glu(gate_F, up_F, activation, clamp, glu_alpha, situ_betas)
            if b_down_ED is not None:
                out_D = out_D + b_down_ED[e]
            y_D = y_D + weights_Tk[t, j] * out_D
        rows.append(y_D)
    return torch.stack(rows)


def latent_experts(
    x_TD: torch.Tensor,
    weights_Tk: torch.Tensor,
    idx_Tk: torch.Tensor,
    w_latent_down_LD: torch.Tensor,
    w_latent_up_DL: torch.Tensor,
    latent_norm_L: torch.Tensor | None,
    eps: float,
    w_gate_up_E2FL: torch.Tensor,
    w_down_ELF: torch.Tensor,
    **experts_kwargs,
) -> torch.Tensor:
    """Kimi K3's latent MoE, routed part: up(rms_norm(sum_j weights[t, j] expert_{idx[t, j]}(down(x[t])))) with the
    experts in the latent width L (no norm when latent_norm_L is None). Returns y_TD in fp64; the shared experts
    (full width, on x) are swiglu_mlp's, added by the caller."""
    latent_TL = _f64(x_TD) @ _f64(w_latent_down_LD).T
    mixed_TL = swiglu_experts(latent_TL, weights_Tk, idx_Tk, w_gate_up_E2FL, w_down_ELF, **experts_kwargs)
    if latent_norm_L is not None:
        mixed_TL = rms_norm(mixed_TL, latent_norm_L, eps)
    return mixed_TL @ _f64(w_latent_up_DL).T
