"""The whole layer on the Numba backend in the CUDA simulator, through the sandbox.

    validate(layer, x, logits, backends=["reference", "numba"]): every stage of the Numba
    backend fed the reference's recorded inputs and judged against the exact (float64)
    reference, plus the layer end to end (sandbox/validate.py says how each stage is judged).

Mixed mappings (Numba stages beside reference stages) must give the reference's output too.
Tiny layers: every GEMM tile is a block of simulated threads.
"""
import numpy as np
import pytest

from sandbox.layer import FusedMoE
from sandbox.validate import validate

pytestmark = pytest.mark.simulator


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_validate_numba_backend(kind, dtype):
    if kind == "mixtral":
        layer = FusedMoE.random(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6,
                                params_dtype=dtype, block_size=4)
    else:
        layer = FusedMoE.random(num_experts=8, top_k=3, hidden_size=8, intermediate_size=4,
                                params_dtype=dtype, block_size=4, use_grouped_topk=True,
                                num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                                routed_scaling_factor=2.5, has_bias=True)
    x, logits = layer.random_inputs(3, seed=1)
    report = validate(layer, x, logits, backends=["numba"])
    assert report.ok, report.table()
    assert report.first_divergence["numba"] is None


def test_mixed_mapping():
    layer = FusedMoE.random(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6,
                            block_size=4)
    x, logits = layer.random_inputs(3, seed=2)
    want = layer.forward(x, logits)
    for mapping in ({"route": "numba"}, {"align": "numba", "gemm2": "numba"},
                    {"gemm1": "numba", "activation": "numba", "combine": "numba"}):
        got = layer.with_backend(mapping).forward(x, logits)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 1e-5, (mapping, err)
