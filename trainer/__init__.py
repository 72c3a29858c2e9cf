"""loraplex trainer: the GPU training side (executor recipe, multi-LoRA engine, objectives,
strategies, model families, data, early exit, admission, checkpoints, export). Imports torch and
transformers only (plus service.protocol, pydantic-only). Import submodules explicitly."""
