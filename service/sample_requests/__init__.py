"""Samples on demand (issue 44): a tenant's prompts answered by a finished task's adapters and its
base model on a node that serves that model (states; lifecycle: requests, claims, leases)."""
