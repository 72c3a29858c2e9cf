"""loraplex service: the FastAPI API, Postgres state, Redis queues and the worker protocol.
The GPU side imports only service.protocol from here (pydantic, or with torch + transformers
alone its plain stand-in: the same shapes, unvalidated)."""
