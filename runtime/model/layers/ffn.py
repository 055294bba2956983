"""FFN layers: the dense gated MLP and the MoE block (router, routed experts, shared expert).

Shape legend: B batch, T tokens, D model width, E experts, F expert width, k experts per token.
Experts are stored stacked ([E, 2F, D] gate rows then up rows, [E, D, F]) for grouped GEMMs; the
weight map stacks the release's per-expert tensors into them. Either is a Parameter, or a StoredWeight
(runtime/formats/weight.py) when the release ships it quantized: decoded for the op one layer at a time.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.spec import MoEFFN
from runtime.dispatch import op
from runtime.formats.linear import decoded_for_op
from runtime.formats.weight import StoredWeight
from runtime.ops.stored_matmul.torch_form import format_kwargs
from runtime.model.layers.lora_linear import weight_of
from runtime.model.layers.norm import RMSNorm
from runtime.ops.moe.torch_form import SCORINGS, router_logits


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, width: int, activation: str = "silu",
                 situ_betas: tuple[float, float | None] | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.up_proj = nn.Linear(hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)
        self.activation = activation
        # SiTU-GLU's (beta, linear_beta), passed only where set so that other ops' signatures stay as they are
        self.options = dict(situ_betas=situ_betas) if situ_betas is not None else {}

    def forward(self, x_BTD: torch.Tensor, gate_1D: torch.Tensor | None = None,
                residual_BTD: torch.Tensor | None = None) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), times sigmoid(x @ gate_1D^T) and plus residual_BTD when given
        (the shared expert: the kernel folds both into its passes; it may write residual_BTD in place)."""
        mlp = op("swiglu_mlp", x_BTD.device)
        return mlp(x_BTD, weight_of(self.gate_proj), weight_of(self.up_proj), weight_of(self.down_proj), self.activation,
                   gate_1D=gate_1D, residual_TD=residual_BTD, **self.options)


class Router(nn.Module):
    def __init__(self, config: MoEFFN, hidden_size: int):
        super().__init__()
        self.config, self.top_k = config.router, config.top_k
        num_experts = config.num_experts
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if self.config.bias else None
        if self.config.correction_bias:
            self.register_buffer("correction_bias", torch.zeros(num_experts))
        else:
            self.correction_bias = None
        # LoRA on the router (runtime/lora/factors.py, off by default): A [r, D], B [E, r], fp32
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scale, self.lora_merged = 0.0, False
        # Alignment pins the expert choice of a bf16 run to the fp32 run's, to measure bf16 numerics
        # apart from discrete routing flips (which it counts separately).
        self.pinned_idx: torch.Tensor | None = None
        # the auxiliary load-balancing loss (runtime/train/balance.py) reads each forward's sum over tokens of
        # softmax(logits) [E], with its graph; kept only while that loss is on
        self.keep_prob_sum = False
        self.last_prob_sum: torch.Tensor | None = None

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_Tk fp32, idx_Tk). Logits in fp32: routing decisions are precision-sensitive."""
        logits_TE = router_logits(x_TD, self.effective_weight(), self.bias)
        self.last_prob_sum = logits_TE.softmax(-1).sum(0) if self.keep_prob_sum else None
        if self.pinned_idx is not None:
            return self._weights_for(logits_TE, self.pinned_idx), self.pinned_idx
        r = self.config
        return op("moe_router", x_TD.device)(
            logits_TE, self.top_k, scoring=r.scoring, norm_topk_prob=r.norm_topk_prob,
            routed_scaling_factor=r.routed_scaling_factor, correction_bias_E=self.correction_bias,
            num_groups=r.num_groups, topk_groups=r.topk_groups, topk_before_softmax=r.topk_before_softmax)

    def effective_weight(self) -> torch.Tensor:
        if self.lora_A is None or self.lora_merged:
            return self.weight
        return self.weight + (self.lora_scale * (self.lora_B @ self.lora_A)).to(self.weight.dtype)

    def _weights_for(self, logits_TE: torch.Tensor, idx_Tk: torch.Tensor) -> torch.Tensor:
        """The routing weights the router gives experts idx_Tk (same scoring and normalization rules)."""
        r = self.config
        if r.topk_before_softmax:
            return logits_TE.gather(1, idx_Tk).softmax(-1) * r.routed_scaling_factor
        scores_TE = SCORINGS[r.scoring](logits_TE)
        weights_Tk = scores_TE.gather(1, idx_Tk)
        if r.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(-1, keepdim=True)
        return weights_Tk * r.routed_scaling_factor


class Experts(nn.Module):
    def __init__(self, config: MoEFFN, hidden_size: int):
        super().__init__()
        E, width = config.num_experts, config.expert_intermediate_size
        self.w_gate_up = nn.Parameter(torch.zeros(E, 2 * width, hidden_size))
        self.w_down = nn.Parameter(torch.zeros(E, hidden_size, width))
        self.b_gate_up = nn.Parameter(torch.zeros(E, 2 * width)) if config.expert_bias else None
        self.b_down = nn.Parameter(torch.zeros(E, hidden_size)) if config.expert_bias else None
        self.options = dict(activation=config.activation, clamp=config.swiglu_limit, glu_alpha=config.swiglu_alpha,
                            interleaved_gate_up=config.interleaved_gate_up)
        if config.situ_betas is not None:
            self.options["situ_betas"] = config.situ_betas
        # LoRA on the routed experts (runtime/lora/factors.py): stacked fp32 factors for the grouped GEMMs,
        # A_gu [E, r, D], B_gu [E, 2F, r], A_d [E, r, F], B_d [E, D, r]
        self.lora_gate_up_A: nn.Parameter | None = None
        self.lora_gate_up_B: nn.Parameter | None = None
        self.lora_down_A: nn.Parameter | None = None
        self.lora_down_B: nn.Parameter | None = None
        self.lora_scale, self.lora_merged = 0.0, False

    def forward(self, x_TD, weights_Tk, idx_Tk) -> torch.Tensor:
        if self.stored_format() is not None:
            return self.run_stored(x_TD, weights_Tk, idx_Tk)
        experts = op("moe_experts", x_TD.device)
        w_gate_up, w_down = self.op_weights(x_TD.dtype)
        return experts(x_TD, weights_Tk, idx_Tk, w_gate_up, w_down, b_gate_up_E2F=self.b_gate_up,
                       b_down_ED=self.b_down, **self.options, **self._lora_args(x_TD.dtype))

    def stored_format(self):
        """The format both expert weights are stored in; None unless both are stored alike."""
        w_gu, w_d = self.w_gate_up, self.w_down
        stored = isinstance(w_gu, StoredWeight) and isinstance(w_d, StoredWeight) and w_gu.format == w_d.format
        return w_gu.format if stored else None

    def run_stored(self, x_TD, weights_Tk, idx_Tk, view=lambda t: t) -> torch.Tensor:
        """The moe_experts_stored op on the stored codes and scales (view: to their local part under EP)."""
        experts = op("moe_experts_stored", x_TD.device)
        return experts(x_TD, weights_Tk, idx_Tk, *self.w_gate_up.operands(view), *self.w_down.operands(view),
                       **format_kwargs(self.w_gate_up.format), b_gate_up_E2F=_maybe(view, self.b_gate_up),
                       b_down_ED=_maybe(view, self.b_down), **self.options, **self._lora_args(x_TD.dtype, view))

    def op_weights(self, dtype: torch.dtype, view=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up, w_down) as the op takes them: the Parameters (view mapped), or stored ones decoded in dtype."""
        return tuple(decoded_for_op(w, dtype, view) if isinstance(w, StoredWeight) else view(w)
                     for w in (self.w_gate_up, self.w_down))

    def _lora_args(self, dtype: torch.dtype, view=lambda t: t) -> dict:
        """The op's LoRA arguments; view maps each factor first (expert parallelism: to its local part)."""
        # the grouped GEMMs take one dtype: the fp32 factors are cast to the activations' (autograd casts back)
        if self.lora_gate_up_A is None or self.lora_merged:
            return {}
        factors = (self.lora_gate_up_A, self.lora_gate_up_B, self.lora_down_A, self.lora_down_B)
        A_gu, B_gu, A_d, B_d = (view(t).to(dtype) for t in factors)
        return dict(lora_gate_up=(A_gu, B_gu), lora_down=(A_d, B_d), lora_scale=self.lora_scale)


def _maybe(view, t):
    return None if t is None else view(t)


class MoE(nn.Module):
    def __init__(self, config: MoEFFN, hidden_size: int, norm_eps: float = 1e-6):
        super().__init__()
        self.router = Router(config, hidden_size)
        # Kimi K3's latent MoE: the routed experts between a down- and an up-projection (and a latent RMSNorm)
        latent = config.latent_size
        self.latent_down = nn.Linear(hidden_size, latent, bias=False) if latent else None
        self.latent_norm = RMSNorm(latent, norm_eps) if latent and config.latent_norm else None
        self.latent_up = nn.Linear(latent, hidden_size, bias=False) if latent else None
        self.experts = Experts(config, latent or hidden_size)
        self.shared = GatedMLP(hidden_size, config.shared_intermediate_size, config.activation, config.situ_betas) \
            if config.num_shared_experts else None
        self.shared_gate = nn.Linear(hidden_size, 1, bias=False) if config.shared_expert_gate else None
        self.last_routing: torch.Tensor | None = None  # idx_Tk of the last forward, for routing-flip counts

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        weights_Tk, idx_Tk = self.router(x_TD)
        self.last_routing = idx_Tk.detach()
        y_TD = self.routed(x_TD, weights_Tk, idx_Tk)
        return self.add_shared(x_TD, y_TD).view(B, T, D)

    def routed(self, x_TD: torch.Tensor, weights_Tk: torch.Tensor, idx_Tk: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum; in a latent MoE, run on down(x) and brought back by up(norm(.))."""
        if self.latent_down is None:
            return self.experts(x_TD, weights_Tk, idx_Tk)
        y_TL = self.experts(self.latent_down(x_TD), weights_Tk, idx_Tk)
        return self.latent_up(self.latent_norm(y_TL) if self.latent_norm is not None else y_TL)

    def add_shared(self, x_TD: torch.Tensor, routed_TD: torch.Tensor) -> torch.Tensor:
        """routed + (sigmoid-gated) shared expert of x; routed_TD may be overwritten with the sum.
        (bench/bench_moe.py times the block through this too.)"""
        if self.shared is None:
            return routed_TD
        gate_1D = None if self.shared_gate is None else weight_of(self.shared_gate)
        return self.shared(x_TD, gate_1D, routed_TD)
