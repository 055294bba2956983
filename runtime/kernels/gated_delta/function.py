"""Autograd function over the GDN/KDA Triton kernels: launches, buffers and the packed layout.

Batch is folded into time: [B, T, H, *] becomes [B*T, H, *] with B sequences given by cu_seqlens,
so one set of kernels serves the batched and the packed (varlen) case.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NC chunks over all
sequences, C chunk size, X 1 (GDN) or K (KDA).
"""
from __future__ import annotations

import torch
import triton

from runtime.kernels.gated_delta import backward, forward

CHUNK_SIZE = 64
SUB_CHUNK = 16
VALUE_BLOCK = 64
# tf32 keeps the in-chunk products within ~1e-3 of fp32 and runs on tensor cores
DOT_PRECISION = "tf32"
# The chunk loops load [C, K] fp32 tiles: pipelining them (num_stages > 1) overflows shared memory
# (278 KB asked of 227 KB on the H200), so the looping kernels run with num_stages=1.


def empty(*shape, dtype, device) -> torch.Tensor:
    """Every kernel-written buffer comes from here (tests swap in a NaN-filled one)."""
    return torch.empty(*shape, dtype=dtype, device=device)


class ChunkLayout:
    """Where each chunk of each packed sequence starts and ends (int32 device tensors)."""

    def __init__(self, cu_seqlens, chunk_offsets, chunk_start, chunk_end):
        self.cu_seqlens, self.chunk_offsets = cu_seqlens.to(torch.int32), chunk_offsets.to(torch.int32)
        self.chunk_start, self.chunk_end = chunk_start.to(torch.int32), chunk_end.to(torch.int32)
        self.num_seqs, self.num_chunks = len(cu_seqlens) - 1, len(chunk_start)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, chunk_size: int) -> "ChunkLayout":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
        chunk_offsets = torch.cat([chunks_per_seq.new_zeros(1), chunks_per_seq.cumsum(0)])
        seq_of_chunk = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), chunks_per_seq)
        index_in_seq = torch.arange(len(seq_of_chunk), device=cu_seqlens.device) - chunk_offsets[seq_of_chunk]
        start = cu_seqlens[seq_of_chunk] + index_in_seq * chunk_size
        end = torch.minimum(start + chunk_size, cu_seqlens[seq_of_chunk + 1])
        return cls(cu_seqlens, chunk_offsets, start, end)

    @classmethod
    def batched(cls, batch: int, num_tokens: int, chunk_size: int, device) -> "ChunkLayout":
        """B sequences of T tokens, built without a device-to-host sync."""
        per_seq = -(-num_tokens // chunk_size)
        seq_of_chunk = torch.arange(batch * per_seq, device=device) // per_seq
        start = seq_of_chunk * num_tokens + (torch.arange(batch * per_seq, device=device) % per_seq) * chunk_size
        end = torch.minimum(start + chunk_size, (seq_of_chunk + 1) * num_tokens)
        cu_seqlens = torch.arange(batch + 1, device=device) * num_tokens
        return cls(cu_seqlens, torch.arange(batch + 1, device=device) * per_seq, start, end)


def _config():
    return dict(C=CHUNK_SIZE, S=min(SUB_CHUNK, CHUNK_SIZE), PREC=DOT_PRECISION)


def _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv):
    """Chunk-local fp32 quantities of prep_kernel, as a dict."""
    num_tokens, num_heads, key_dim = q.shape
    cfg = _config()
    f32 = dict(dtype=torch.float32, device=q.device)
    out = {name: empty(num_tokens, num_heads, key_dim, **f32) for name in ("qg", "kbar", "w")}
    out["u"] = empty(*v.shape, **f32)
    out["p"] = empty(num_tokens, num_heads, cfg["C"], **f32)
    out["tinv"] = empty(num_tokens, num_heads, cfg["C"], **f32) if store_tinv else out["p"]
    out["glast"] = empty(layout.num_chunks, num_heads, key_dim if per_channel else 1, **f32)
    forward.prep_kernel[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, layout.chunk_start, layout.chunk_end,
        out["qg"], out["kbar"], out["w"], out["u"], out["p"], out["glast"], out["tinv"], scale,
        H=num_heads, K=key_dim, V=v.shape[-1], PER_CHANNEL=per_channel, L2NORM=l2norm,
        STORE_TINV=store_tinv, num_warps=8, **cfg)
    return out


def _scan(prep, h0, layout, per_channel, store_final):
    """(h of every chunk [NC, H, K, V], v_new [T, H, V], final state [N, H, K, V] or None), fp32."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = prep["u"].shape[-1]
    f32 = dict(dtype=torch.float32, device=prep["w"].device)
    h = empty(layout.num_chunks, num_heads, key_dim, value_dim, **f32)
    v_new = empty(num_tokens, num_heads, value_dim, **f32)
    final = empty(layout.num_seqs, num_heads, key_dim, value_dim, **f32) if store_final else h
    block = min(VALUE_BLOCK, value_dim)
    forward.scan_kernel[(layout.num_seqs, num_heads, value_dim // block)](
        prep["w"], prep["u"], prep["kbar"], prep["glast"], h0 if h0 is not None else h,
        layout.cu_seqlens, layout.chunk_offsets, h, v_new, final,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PER_CHANNEL=per_channel,
        HAS_H0=h0 is not None, STORE_FINAL=store_final, PREC=DOT_PRECISION, num_warps=4, num_stages=1)
    return h, v_new, final if store_final else None


def _output(prep, h, v_new, layout, out_dtype):
    num_tokens, num_heads, key_dim = prep["qg"].shape
    value_dim = v_new.shape[-1]
    o = empty(num_tokens, num_heads, value_dim, dtype=out_dtype, device=v_new.device)
    block = min(VALUE_BLOCK, value_dim)
    forward.output_kernel[(layout.num_chunks, num_heads, value_dim // block)](
        prep["qg"], prep["p"], h, v_new, layout.chunk_start, layout.chunk_end, o,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PREC=DOT_PRECISION, num_warps=4)
    return o


def _scan_bwd(prep, do, dht, layout, per_channel, want_dh0):
    """(dh leaving every chunk [NC, H, K, V], dv_new [T, H, V], dh0 [N, H, K, V] or None), fp32."""
    num_tokens, num_heads, key_dim = prep["w"].shape
    value_dim = do.shape[-1]
    f32 = dict(dtype=torch.float32, device=do.device)
    dh = empty(layout.num_chunks, num_heads, key_dim, value_dim, **f32)
    dv_new = empty(num_tokens, num_heads, value_dim, **f32)
    dh0 = empty(layout.num_seqs, num_heads, key_dim, value_dim, **f32) if want_dh0 else dh
    block = min(VALUE_BLOCK, value_dim)
    backward.scan_bwd_kernel[(layout.num_seqs, num_heads, value_dim // block)](
        do, prep["p"], prep["kbar"], prep["qg"], prep["w"], prep["glast"], dht if dht is not None else dh,
        layout.cu_seqlens, layout.chunk_offsets, dh, dv_new, dh0,
        H=num_heads, K=key_dim, V=value_dim, C=CHUNK_SIZE, BV=block, PER_CHANNEL=per_channel,
        HAS_DHT=dht is not None, STORE_DH0=want_dh0, PREC=DOT_PRECISION, num_warps=4, num_stages=1)
    return dh, dv_new, dh0 if want_dh0 else None


def _input_grads(q, k, v, g, beta, do, prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm):
    """(dq, dk, dv, dg, dbeta) in the inputs' dtypes."""
    num_tokens, num_heads, key_dim = q.shape
    grads = [empty(*t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v, g, beta)]
    backward.grad_kernel[(layout.num_chunks, num_heads)](
        q, k, v, g, beta, prep["tinv"], h, dh, v_new, dv_new, do, layout.chunk_start, layout.chunk_end,
        *grads, scale, H=num_heads, K=key_dim, V=v.shape[-1], BV=min(VALUE_BLOCK, v.shape[-1]),
        PER_CHANNEL=per_channel, L2NORM=l2norm, num_warps=8, num_stages=1, **_config())
    return grads


class ChunkDeltaRule(torch.autograd.Function):
    """Packed inputs q, k [T, H, K], v [T, H, V], g [T, H] or [T, H, K], beta [T, H]; h0 [N, H, K, V] fp32;
    layout: the ChunkLayout of the N packed sequences."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, layout, scale, l2norm):
        per_channel = g.dim() == 3
        prep = _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv=False)
        h, v_new, final = _scan(prep, h0, layout, per_channel, store_final=True)
        o = _output(prep, h, v_new, layout, q.dtype)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.settings = (layout, scale, l2norm, per_channel)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        layout, scale, l2norm, per_channel = ctx.settings
        prep = _prep(q, k, v, g, beta, layout, scale, per_channel, l2norm, store_tinv=True)
        h, v_new, _ = _scan(prep, h0, layout, per_channel, store_final=False)
        dh, dv_new, dh0 = _scan_bwd(prep, do.contiguous(), dfinal, layout, per_channel, h0 is not None)
        dq, dk, dv, dg, dbeta = _input_grads(
            q, k, v, g, beta, do.contiguous(), prep, h, dh, v_new, dv_new, layout, scale, per_channel, l2norm)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunk_delta_rule(q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, scale, initial_state_BHKV, use_qk_l2norm, cu_seqlens):
    """Shared entry of gated_delta_rule and kda: checks, packs the batch into time, unpacks the output."""
    batch, num_tokens, num_heads, key_dim = q_BTHK.shape
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs batch 1, got q of shape {tuple(q_BTHK.shape)}")
    if cu_seqlens is None:
        layout = ChunkLayout.batched(batch, num_tokens, CHUNK_SIZE, q_BTHK.device)
    else:
        layout = ChunkLayout.packed(cu_seqlens.to(q_BTHK.device, torch.int64), CHUNK_SIZE)
    scale = key_dim**-0.5 if scale is None else float(scale)
    packed = [t.flatten(0, 1).contiguous() for t in (q_BTHK, k_BTHK, v_BTHV, g, beta_BTH)]
    h0 = None if initial_state_BHKV is None else initial_state_BHKV.float().contiguous()
    o, final = ChunkDeltaRule.apply(*packed, h0, layout, scale, use_qk_l2norm)
    return o.unflatten(0, (batch, num_tokens)), final
