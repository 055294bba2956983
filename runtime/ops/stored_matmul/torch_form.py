"""Torch form of the matmul over a frozen base weight in its released format: the weight decoded with
runtime/formats/codec.py into the activations' dtype as the matmul needs it, and decoded again in the backward
instead of being kept (one projection's or one layer's experts' weight at a time, never the model's).

`saved_as_codes` is that rule for any torch composition (the experts' grouped matmuls in runtime/ops/moe/torch_form.py):
autograd keeps the decoding recipe where it would save the decoded weight or a view of it.
Contract and format keywords: README.md beside this file. Shape legend: T tokens, O out width, I in width, r rank.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from runtime.formats.codec import fp8_block_decode, mxfp4_decode
from runtime.formats.saved import redecodable, redecoding

E8M0_BIAS = 127


def format_kwargs(fmt) -> dict:
    """The ops' format keywords from a runtime/formats/scheme.py StoredFormat."""
    return dict(kind=fmt.kind, block=tuple(fmt.block) if fmt.kind == "fp8_block" else None)


def decode(codes: torch.Tensor, scale: torch.Tensor, kind: str, block: tuple[int, int] | None,
           dtype: torch.dtype) -> torch.Tensor:
    """The logical weight [.., O, I] in dtype (gpt-oss's MXFP4 blocks [.., O, G, 16] read as their packed rows)."""
    if kind == "fp8_block":
        if scale.dtype == torch.uint8:
            # UE8M0 scales handed over as their bytes
            scale = torch.exp2(scale.to(torch.float32) - E8M0_BIAS)
        return fp8_block_decode(codes, scale, tuple(block), dtype)
    if kind == "mxfp4":
        codes = codes.flatten(-2) if codes.dim() == scale.dim() + 1 else codes
        scale = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
        return mxfp4_decode(codes, scale, dtype)
    raise ValueError(f"stored format {kind!r}: expected fp8_block or mxfp4")


def stored_operands(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales as the kernels read them: unit stride along a row (gpt-oss's MXFP4 blocks [.., O, G, 16]
    flattened to their packed rows [.., O, G * 16]), E8M0 scales as their bytes."""
    if kind == "mxfp4" and codes.dim() == scale.dim() + 1:
        codes = codes.flatten(-2)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    return codes, scale


@contextlib.contextmanager
def saved_as_codes(weights: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]) -> Iterator[None]:
    """Inside, a tensor autograd saves that is one of `weights`' decoded tensors (or a view of one) is kept as its
    (re-decode, view geometry) and decoded again when the backward reads it; every other saved tensor goes on to the
    saved-tensor hooks active outside (activation offload, recompute, the saved-bytes count):
    runtime/formats/saved.py."""
    with redecoding():
        for w, redo in weights:
            if w.numel():
                redecodable(w, redo)
        yield


class _StoredMatmul(torch.autograd.Function):
    """x [T, I] @ decode(codes, scale)^T; the backward decodes again for dx = dy @ W (no weight gradient: frozen)."""

    @staticmethod
    def forward(ctx, x_TI, codes, scale, kind, block):
        ctx.save_for_backward(codes, scale)
        ctx.kind, ctx.block = kind, block
        return x_TI @ decode(codes, scale, kind, block, x_TI.dtype).T

    @staticmethod
    def backward(ctx, dy_TO):
        codes, scale = ctx.saved_tensors
        dx = dy_TO @ decode(codes, scale, ctx.kind, ctx.block, dy_TO.dtype) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None


def stored_linear(
    x_TI: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    *,
    kind: str,
    block: tuple[int, int] | None = None,
    bias_O: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """y = x W^T + b + lora_scale * (x A^T) B^T, W = decode(codes, scale); x [.., I] -> y [.., O] in x's dtype."""
    x = x_TI.reshape(-1, x_TI.shape[-1])
    y = _StoredMatmul.apply(x, codes, scale, kind, block)
    if bias_O is not None:
        y = y + bias_O.to(y.dtype)
    if lora is not None:
        A_rI, B_Or = (f.to(x.dtype) for f in lora)
        y = torch.addmm(y, x @ A_rI.T, B_Or.T, alpha=lora_scale)
    return y.view(*x_TI.shape[:-1], y.shape[-1])
