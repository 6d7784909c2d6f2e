"""The expert-parallel runtime (sandbox/ep/): CPU communicator, fake NCCL, GPUs."""
