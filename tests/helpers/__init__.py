"""Shared test helpers: tiny local models, synthetic JSONL data, and single-job PEFT baselines.
Imported by the engine, data and export tests (CPU) and by the GPU tests."""
