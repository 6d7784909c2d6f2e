"""Argument checks that both backends' launchers share (the array checks are each backend's own:
they know its array types)."""
from __future__ import annotations

import numpy as np


def check_int(name, value, minimum=None, maximum=None):
    """A Python or NumPy integer (not a bool) in [minimum, maximum], returned as an int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value}")
    return value
