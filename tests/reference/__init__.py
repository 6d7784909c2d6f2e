"""The NumPy reference (reference/): every stage against loop oracles, properties, errors."""
