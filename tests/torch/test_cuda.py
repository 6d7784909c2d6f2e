"""The torch backend on CUDA tensors (`gpu` marker): the stages against the reference, and
select_experts' tail (custom functions, zero experts) coming back on the device.

    T = tokens, E = experts, K = top-k
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import TOL, gemm_problem, rng_for
from tests.oracles import rel_err_where_defined as rel

DTYPES = [np.float32, ml_dtypes.bfloat16]

torch = pytest.importorskip("torch")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cuda_stages(dtype):
    """On the GPU: every stage on CUDA tensors against the reference."""
    assert tb.device().type == "cuda"
    rng = rng_for("cuda", str(dtype))
    args, want = gemm_problem(300, 8, 2, 256, 128, 64, dtype, bias=dtype, mul=True)
    for impl in ("loop", "grouped_mm"):
        got_t = tb.grouped_gemm(*(tb.to_device(v) if isinstance(v, np.ndarray) else v
                                  for v in args), impl=impl)
        assert got_t.is_cuda
        assert rel(host(got_t), want) <= TOL[np.dtype(dtype)]
    logits = rng.standard_normal((300, 8)).astype(np.float32)
    ew, eids, _ = reference.fused_topk(None, logits, 2, True)
    gw, gids, _ = tb.fused_topk(None, tb.to_device(logits), 2, True)
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-5
    got = [host(v) for v in tb.moe_align_block_size(tb.to_device(eids), 64, 8)]
    for g, wnt in zip(got, reference.moe_align_block_size(eids, 64, 8)):
        assert np.array_equal(g, wnt)


@pytest.mark.gpu
def test_torch_cuda_select_experts_tail():
    """select_experts on CUDA tensors through the shared dispatcher: a NumPy custom routing
    function's results come back on the device, zero experts are computed there."""
    assert tb.device().type == "cuda"
    rng = rng_for("cuda select")
    t, e, z, k = 37, 8, 2, 3
    x = rng.standard_normal((t, 16)).astype(np.float32)
    logits = rng.standard_normal((t, e + z)).astype(np.float32)
    logits[:4, e:] += 3.0
    kw = dict(global_num_experts=e, zero_expert_num=z, zero_expert_type="identity")
    ew, eids, ez = reference.select_experts(x, logits, k, False, True, **kw)
    gw, gids, gz = tb.select_experts(tb.to_device(x), tb.to_device(logits), k, False, True, **kw)
    assert gw.is_cuda and gids.is_cuda and gz.is_cuda
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-5
    assert rel(host(gz), ez) <= 1e-5
    fn = reference.llama4_custom_routing_function
    ew, eids, _ = reference.select_experts(None, logits[:, :e], 1, False, False,
                                           custom_routing_function=fn)
    gw, gids, _ = tb.select_experts(None, tb.to_device(logits[:, :e]), 1, False, False,
                                    custom_routing_function=fn)
    assert gw.is_cuda and gids.is_cuda
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-6
