"""FAKE cupy.random."""
import numpy as _np


class RandomState:
    def __init__(self, seed=None):
        self._rng = _np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=_np.float64):
        from . import ndarray
        return ndarray(self._rng.standard_normal(size, dtype=dtype))

    def random_sample(self, size=None, dtype=_np.float64):
        from . import ndarray
        return ndarray(self._rng.random(size, dtype=dtype))
