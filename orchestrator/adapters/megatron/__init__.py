"""The Megatron-core trainer adapter: the trainer, its model build on CPU/gloo, the fast cast, HF conversion."""
