"""bench/bench_stored_formats.py's CPU path (--tiny): the DeepSeek-V3 slice at tiny widths, experts and FP8 projections,
every variant timed and the fused kernels (under the interpreter) checked against the torch form first, the JSON
written; so the GPU run the lead makes meets no broken script."""
import json

import pytest

pytestmark = pytest.mark.interpreter


def test_tiny_slice_runs_checks_and_writes_json(tmp_path):
    from bench import bench_stored_formats as bench

    bench.main(["--tiny", "--slices", "deepseek-v3", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "stored-formats-tiny.json").read_text())
    result = written["slices"]["deepseek-v3"]
    assert result["fused_backend"] == "triton" and result["correct"]
    # the experts' output and their input, routing and LoRA gradients, and each projection's
    assert {"experts/out", "experts/grad:x", "experts/grad:weights", "experts/grad:A_d", "o_proj/grad:B"} <= set(result["correctness"])
    for part in ("experts", "projections"):
        assert set(result[part]) == {"stored", "bf16", "dequantize"}
        assert all(m["fits"] and m["tokens_per_s"] > 0 for m in result[part].values())
