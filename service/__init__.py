"""loraplex service: the FastAPI API, Postgres state, Redis queues and the worker protocol.
The GPU side imports only service.protocol from here (it needs pydantic alone)."""
