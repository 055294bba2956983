"""The causal conv1d and the cross-entropy rows on CUDA: time and precision of the fused kernels against torch.

Causal conv (+ silu) at the Qwen3-Next slice's GDN width (B1 T4096 C8192 W4, bf16), fwd+bwd ms: the kernel
(runtime/ops/conv/kernel.py), the torch form (fp32 depthwise conv, casts and transposes around it), torch's
depthwise conv1d in bf16, and a bf16 sum of W shifted products; each output's relative RMS error against fp64,
and the kernel's input gradient's. The cross-entropy rows kernel (runtime/ops/loss/kernel.py) on 256 rows of a
151936-word vocabulary in bf16: loss and gradient against fp64.

    python bench/bench_short_ops.py [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_ops.conv import causal_conv1d as reference_conv  # noqa: E402
from reference_ops.loss import cross_entropy_rows as reference_rows  # noqa: E402
from runtime.ops.conv.kernel import causal_conv1d as kernel_conv  # noqa: E402
from runtime.ops.loss.kernel import cross_entropy_rows as kernel_rows  # noqa: E402
from runtime.ops.conv.torch_form import causal_conv1d as torch_form_conv  # noqa: E402

REPS = 20


def torch_bf16_conv(x_BTC, weight_CW):
    width = weight_CW.shape[1]
    y_BCT = F.conv1d(x_BTC.transpose(1, 2), weight_CW.unsqueeze(1), None, padding=width - 1, groups=x_BTC.shape[2])
    return F.silu(y_BCT[..., :x_BTC.shape[1]].transpose(1, 2))


def shifted_sum_conv(x_BTC, weight_CW):
    width, T = weight_CW.shape[1], x_BTC.shape[1]
    padded = F.pad(x_BTC, (0, 0, width - 1, 0))
    return F.silu(sum(padded[:, i:i + T] * weight_CW[:, i] for i in range(width)))


CONVS = {"kernel": kernel_conv, "torch_form_fp32": torch_form_conv, "torch_bf16_conv1d": torch_bf16_conv,
         "bf16_shifted_sum": shifted_sum_conv}


def fwd_bwd_ms(fn, x, w) -> float:
    for _ in range(3):
        fn(x, w).sum().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPS):
        fn(x, w).sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPS * 1e3


def rel_rms(a: torch.Tensor, e: torch.Tensor) -> float:
    return float((a.double() - e).norm() / e.norm())


def conv_results() -> dict:
    x = torch.randn(1, 4096, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8192, 4, device="cuda") * 0.3).to(torch.bfloat16)
    expected = reference_conv(x.detach(), w)
    out = {}
    for name, fn in CONVS.items():
        out[name] = dict(fwd_bwd_ms=fwd_bwd_ms(fn, x, w), out_rel_rms=rel_rms(fn(x.detach(), w), expected))
    x_run, x_ref = x.detach().clone().requires_grad_(), x.detach().double().requires_grad_()
    cotangent = torch.randn_like(x_ref)
    kernel_conv(x_run, w).backward(cotangent.to(torch.bfloat16))
    reference_conv(x_ref, w).backward(cotangent)
    out["kernel"]["dx_rel_rms"] = rel_rms(x_run.grad, x_ref.grad)
    return out


def loss_results() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 151936, (256,), device="cuda", generator=gen)
    labels[::7] = -100
    expected_loss, expected_grad = reference_rows(logits, labels)
    loss, grad = kernel_rows(logits.clone(), labels)
    return dict(loss_rel_rms=rel_rms(loss, expected_loss), grad_rel_rms=rel_rms(grad, expected_grad))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = dict(name="short-ops", device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  shape="conv B1 T4096 C8192 W4 bf16; cross-entropy rows 256 x 151936 bf16",
                  command="python bench/bench_short_ops.py --out $OUT", conv=conv_results(), loss=loss_results())
    for name, r in result["conv"].items():
        print(f"{name:22s} {r['fwd_bwd_ms']:7.3f} ms   out rel RMS {r['out_rel_rms']:.1e}")
    print(f"cross-entropy rows kernel: loss rel RMS {result['loss']['loss_rel_rms']:.1e}, "
          f"grad {result['loss']['grad_rel_rms']:.1e}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "short-ops.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
