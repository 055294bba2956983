"""A frozen base weight held as its release stores it: codes and scales, decoded one layer at a time when used.

StoredWeight keeps two frozen Parameters, `codes` and `scale`, whose shapes follow from the weight's logical shape
and its StoredFormat (stored_shapes). They are held as raw bits in integer dtypes (FP8 codes and MXFP4 packs
uint8, FP8 block scales the float32 bits as int32, E8M0 scales uint8), so that casting the model (`.to(bf16)`,
`.double()`) never converts them; `dtype` is the dtype the weight decodes to by default, and follows those casts
as an nn.Linear's weight would. Parameters rather than buffers: FSDP shards parameters (dim 0 of each, codes and
scales alike) and expert parallelism cuts both on the expert dim.
Shape legend: O rows (out width), I columns (in width), leading dims (experts) pass through.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from runtime.formats import codec
from runtime.formats.scheme import FP8Block, MXFP4
from reference_ops.formats import MXFP4_GROUP

# the integer dtype holding each format's scale bits (FP8 block scales are float32 whatever the release stored:
# bf16 and E8M0 scales convert to float32 exactly)
SCALE_HOLDER = {"fp8_block": torch.int32, "mxfp4": torch.uint8}


def stored_shapes(fmt: FP8Block | MXFP4, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(codes shape, scale shape) of a weight of logical shape [.., O, I] in format `fmt`."""
    *lead, rows, cols = shape
    if isinstance(fmt, FP8Block):
        b_rows, b_cols = fmt.block
        return (*lead, rows, cols), (*lead, math.ceil(rows / b_rows), math.ceil(cols / b_cols))
    if cols % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs a multiple of {MXFP4_GROUP} columns, the weight has {cols}")
    return (*lead, rows, cols // 2), (*lead, rows, cols // MXFP4_GROUP)


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class StoredWeight(nn.Module):
    """codes + scale of one weight (or one stacked expert weight), frozen; `decode(dtype)` gives the weight."""

    def __init__(self, fmt: FP8Block | MXFP4, shape: tuple[int, ...], dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.format = fmt
        codes_shape, scale_shape = stored_shapes(fmt, tuple(shape))
        self.codes = _frozen(codes_shape, torch.uint8, device)
        self.scale = _frozen(scale_shape, SCALE_HOLDER[fmt.kind], device)
        self.dtype = dtype or torch.get_default_dtype()

    @property
    def shape(self) -> torch.Size:
        """The logical shape (a DTensor's global one under expert parallelism)."""
        shape = list(self.codes.shape)
        if isinstance(self.format, MXFP4):
            shape[-1] *= 2
        return torch.Size(shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def decode(self, dtype: torch.dtype | None = None, view=lambda t: t) -> torch.Tensor:
        """The weight [.., O, I] in dtype (default self.dtype); view maps codes and scale first (to a DTensor's local
        part under expert parallelism)."""
        return decode_bits(self.format, view(self.codes), view(self.scale), dtype or self.dtype)

    def operands(self, view=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scale) as the stored-weight ops take them (runtime/ops/stored_matmul/README.md): views of the held
        bits in the release's dtypes (FP8 codes float8_e4m3fn, FP8 scales float32, MXFP4 bytes as they are)."""
        codes, scale = view(self.codes), view(self.scale)
        if isinstance(self.format, FP8Block):
            return codes.view(torch.float8_e4m3fn), scale.view(torch.float32)
        return codes, scale

    def _apply(self, fn, recurse=True):
        # the integer bits never convert; the decode dtype follows the model's casts (a probe shows what fn does)
        super()._apply(fn, recurse)
        probe = fn(torch.zeros(0, dtype=self.dtype, device="cpu" if self.codes.is_meta else self.codes.device))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.format.kind}, shape={tuple(self.shape)}, decodes to {self.dtype}"


def decode_bits(fmt: FP8Block | MXFP4, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode held bits (codes uint8, scale as SCALE_HOLDER says) with runtime/formats/codec.py."""
    if isinstance(fmt, FP8Block):
        return codec.fp8_block_decode(codes.view(torch.float8_e4m3fn), scale.view(torch.float32), fmt.block, dtype)
    return codec.mxfp4_decode(codes, scale, dtype)


def held_bytes(module: nn.Module) -> int:
    """Bytes of every StoredWeight's codes and scales in `module` (local parts of sharded ones)."""
    total = 0
    for m in module.modules():
        if isinstance(m, StoredWeight):
            for t in (m.codes, m.scale):
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total
