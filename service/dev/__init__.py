"""Tools for trying the service on the local stack (not used by the service itself)."""
