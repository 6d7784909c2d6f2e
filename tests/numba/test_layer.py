"""The layer on the Numba backend on a real GPU, through the sandbox: validate() stage by stage
against the exact reference, and mappings that mix Numba and CuPy stages.

`gpu` tests, outputs poisoned (tests/numba/__init__.py says how).
"""
import numpy as np
import pytest

from tests.oracles import BF16, rel_err
from tests.support import gpu_marks

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_validate_layer_on_numba(dtype):
    from sandbox.layer import FusedMoE
    from sandbox.validate import validate

    layer = FusedMoE.random(num_experts=16, top_k=4, hidden_size=256, intermediate_size=192,
                            params_dtype=dtype)
    x, logits = layer.random_inputs(77, seed=3)
    report = validate(layer, x, logits, backends=["reference", "numba"])
    assert report.ok, report.table()


def test_mixed_mappings_numba_and_cupy():
    from sandbox.layer import FusedMoE
    from sandbox.registry import get_backend

    if not get_backend("cupy").ok:
        pytest.skip(f"cupy backend: {get_backend('cupy').reason}")
    layer = FusedMoE.random(num_experts=8, top_k=2, hidden_size=128, intermediate_size=256)
    x, logits = layer.random_inputs(33, seed=4)
    want = layer.forward(x, logits)
    for mapping in ({"route": "numba", "align": "numba", "gemm1": "cupy", "activation": "cupy",
                     "gemm2": "cupy", "combine": "numba"},
                    {"route": "cupy", "align": "cupy", "gemm1": "numba", "activation": "numba",
                     "gemm2": "numba", "combine": "cupy"}):
        got = layer.with_backend(mapping).forward(x, logits)
        assert rel_err(got, want) <= 1e-5, mapping
