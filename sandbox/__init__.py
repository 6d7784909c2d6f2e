"""moe-sandbox: one MoE layer whose stages run on swappable backends, and the harness that
says where two backends part ways.

    FusedMoE            the layer (sandbox/layer.py): its weights, run stage by stage by
                        the pipeline (sandbox/pipeline.py; StageCall, one traced stage)
    MoEWeights          the weights alone and their loaders (sandbox/weights.py)
    validate            stage-by-stage cross-validation (sandbox/validate.py's function: the
                        package attribute `sandbox.validate` is the function, the module is
                        `importlib.import_module("sandbox.validate")`)
    STAGES, get_backend, available_backends, resolve_stage_mapping   (sandbox/registry.py)
"""

from .layer import FusedMoE
from .pipeline import StageCall
from .registry import BACKENDS, STAGES, available_backends, get_backend, resolve_stage_mapping
from .validate import ValidationReport, validate
from .weights import MoEWeights

__all__ = ["BACKENDS", "STAGES", "FusedMoE", "MoEWeights", "StageCall", "ValidationReport",
           "available_backends", "get_backend", "resolve_stage_mapping", "validate"]
