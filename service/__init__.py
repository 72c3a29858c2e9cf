"""loraplex service: the FastAPI API, Postgres state, Redis queues and the internal API of the
node agents. Nothing on the GPU side imports it: what both sides share is in contract/."""
