"""loraplex worker: the node daemon and the training engine (executor, multi-LoRA model, data,
early exit, admission, checkpoints, export). Kept light: import submodules explicitly."""
