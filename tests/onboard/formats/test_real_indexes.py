"""The real DeepSeek-V3 (FP8) and gpt-oss-120b (MXFP4) releases from their weight indexes alone
(tests/data/write_real_indexes.py): logical parameter counts, stored bytes, and the H100 counts the README quotes."""
from __future__ import annotations

import lzma
import shutil
from pathlib import Path

import pytest

from onboard.plan.search import Cluster, Workload, search
from onboard.recognize.recognizer import recognize
from onboard.recognize.stored import as_bf16
from onboard.release.manifest import read_manifest

DATA = Path(__file__).resolve().parents[2] / "data"
H100_GIB, SEQ, RANK = 80, 4096, 16


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """name -> (manifest, spec) of the release folder (index decompressed as the seed example's is)."""
    cache = {}

    def make(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp("real") / name
            out.mkdir()
            shutil.copy(DATA / name / "config.json", out / "config.json")
            with lzma.open(DATA / name / "model.safetensors.index.json.xz") as src:
                (out / "model.safetensors.index.json").write_bytes(src.read())
            manifest = read_manifest(out)
            cache[name] = manifest, recognize(manifest)
        return cache[name]

    return make


def _smallest_h100s(spec) -> int:
    plan = search(spec, Cluster(1, H100_GIB, 8), Workload(SEQ, RANK, None))
    return 1 if plan.chosen else plan.smallest_gpus


def test_gpt_oss_120b(real):
    manifest, spec = real("gpt-oss-120b-mxfp4")
    assert manifest.total_params is None  # bytes of a quantized index give no parameter count
    # 116.8B logical parameters (transformers' model of the config agrees), not the packed bytes' count
    assert spec.params.total + spec.params.buffers == 116_829_156_672
    assert spec.stored_groups["experts_routed"].formats == ["MXFP4 (gpt-oss blocks)", "bf16"]
    assert spec.stored_groups["attention"].formats == ["bf16"]
    # every tensor of the release is read: its stored bytes, computed from logical shapes, are the index's total
    assert sum(group.bytes for group in spec.stored_groups.values()) == manifest.total_bytes
    assert (_smallest_h100s(spec), _smallest_h100s(as_bf16(spec))) == (1, 4)


def test_deepseek_v3(real):
    manifest, spec = real("deepseek-v3-fp8")
    assert spec.params.total == 671_026_419_200 - spec.params.buffers
    experts = spec.stored_groups["experts_routed"]
    # 58 MoE layers x 256 experts x 3 projections of 2048 x 7168 FP8 codes and (16 x 56) float32 block scales
    assert experts.bytes == 58 * 256 * 3 * (2048 * 7168 + 4 * 16 * 56) and experts.formats == ["FP8 e4m3 (128x128 blocks)"]
    # the multi-token-prediction layer the release ships is not loaded: less than the index's total
    assert sum(group.bytes for group in spec.stored_groups.values()) < manifest.total_bytes
    assert (_smallest_h100s(spec), _smallest_h100s(as_bf16(spec))) == (16, 24)
