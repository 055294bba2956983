"""runtime/ops/common/gluon_fallback.py: a Gluon kernel that does not compile with the installed triton warns once and
leaves its place to the Triton kernel for the rest of the process; other errors propagate."""
import pytest

from runtime.ops.common import gluon_fallback


def test_a_gluon_kernel_that_does_not_compile_falls_back_to_triton_once(monkeypatch):
    monkeypatch.setattr(gluon_fallback, "FAILED", set())

    def fail(message):
        raise RuntimeError(message)

    with pytest.warns(UserWarning, match="DSA forward kernel does not compile"):
        assert not gluon_fallback.compiles("DSA forward", lambda: fail("PassManager::run failed"))
    launched = []
    # remembered for the process: not tried again, while the other kernel still runs
    assert not gluon_fallback.compiles("DSA forward", lambda: launched.append("forward"))
    assert gluon_fallback.compiles("DSA dkv", lambda: launched.append("dkv"))
    assert launched == ["dkv"]
    # a CUDA error is not a compile failure
    with pytest.raises(RuntimeError, match="CUDA error"):
        gluon_fallback.compiles("DSA dkv", lambda: fail("CUDA error: an illegal memory access was encountered"))
    assert gluon_fallback.FAILED == {"DSA forward"}
