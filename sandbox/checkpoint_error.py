"""The error of reading a checkpoint, below the two readers that raise it (checkpoint.py for
the float layers, checkpoint_quant.py for the quantized formats)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the asked-for MoE layer."""
