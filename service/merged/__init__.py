"""Merged models: a job's adapter merged into its task's base model, built off the request path
(weights: the merge itself; lifecycle: requests and states; runner: the background thread)."""
