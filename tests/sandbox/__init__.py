"""The layer and its tools (sandbox/): weights, pipeline, registry, validate, bench, CLI."""
