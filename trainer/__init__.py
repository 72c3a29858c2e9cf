"""loraplex trainer: the GPU training side (executor recipe, multi-LoRA engine, objectives,
strategies, model families, data, early exit, admission, checkpoints, export). Imports torch and
transformers only (plus contract.protocol, pydantic-only). Import submodules explicitly."""
