"""The torch backend (cuda_kernels/torch/) against the reference."""
