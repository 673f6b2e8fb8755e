"""``inference.gemm``: oneDNN linears equal ``F.linear`` (padded row counts, folded residual adds, fallbacks)."""

import pytest
import torch
import torch.nn.functional as F

from zerospeed.inference import gemm

onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and gemm._X86), reason="needs oneDNN on x86")


@pytest.mark.parametrize("rows", [1, 13, 64, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_and_residual_add_match_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 128, generator=g), torch.randn(688, 128, generator=g)
    b = torch.randn(688, generator=g) if bias else None
    r = torch.randn(rows, 688, generator=g)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(gemm.linear(x, w, b), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemm.linear_add(r, x, w, b), r + ref, rtol=1e-5, atol=1e-4)
    assert gemm.linear(x, w, b).shape == (rows, 688)


@onednn
def test_large_linears_run_on_onednn_and_small_ones_do_not() -> None:
    w = torch.randn(688, 128)
    with torch.profiler.profile() as prof:
        gemm.linear(torch.randn(77, 128), w, None)  # 6.8 M multiply-adds, 77 rows padded to 80
        gemm.linear_add(torch.randn(80, 688), torch.randn(80, 128), w, None)
        gemm.linear(torch.randn(2, 128), w, None)  # below MIN_MACS
    names = [e.name for e in prof.events()]
    assert names.count("mkldnn::_linear_pointwise") == 2 and names.count("aten::mm") + names.count("aten::addmm") == 1


def test_other_dtypes_and_disabled_mkldnn_fall_back() -> None:
    x, w = torch.randn(64, 128, dtype=torch.float64), torch.randn(688, 128, dtype=torch.float64)
    torch.testing.assert_close(gemm.linear(x, w, None), F.linear(x, w))
    with torch.backends.mkldnn.flags(enabled=False), torch.profiler.profile() as prof:
        gemm.linear(torch.randn(64, 128), torch.randn(688, 128), None)
    assert "mkldnn::_linear_pointwise" not in [e.name for e in prof.events()]
