"""loraplex contract: what the service, the node agent (worker/) and the trainer share, and
nothing else: the message shapes and task settings (protocol), the lifecycle states and their
transition tables (states), the model-family table (families), the Redis names and the placement
job's deletion (redis_jobs), and the one background worker every loop of the service and the
node agent runs on (background). It imports none of service/, worker/ or trainer/, and nothing
beyond the stdlib and pydantic (with torch + transformers alone: protocol's plain stand-in,
_plain_models). Import submodules explicitly."""
