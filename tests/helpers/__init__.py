"""Shared test helpers: tiny local models, synthetic JSONL data, and single-job PEFT baselines,
webhook receivers and tracking-run readers. Imported by the CPU tiers and by the GPU tests."""
