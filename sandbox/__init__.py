"""moe-sandbox: one MoE layer whose stages run on swappable backends, and the harness that
says where two backends part ways.

    FusedMoE            the layer (sandbox/layer.py)
    validate            stage-by-stage cross-validation (sandbox/validate.py); the module is
                        callable, so `sandbox.validate(...)` and `sandbox.validate.validate(...)`
                        are the same call
    STAGES, get_backend, available_backends, resolve_stage_mapping   (sandbox/registry.py)
"""

# the module itself, callable: sandbox.validate(...) == sandbox.validate.validate(...)
from . import validate
from .layer import FusedMoE, StageCall
from .registry import BACKENDS, STAGES, available_backends, get_backend, resolve_stage_mapping
from .validate import ValidationReport

__all__ = ["BACKENDS", "STAGES", "FusedMoE", "StageCall", "ValidationReport",
           "available_backends", "get_backend", "resolve_stage_mapping", "validate"]
