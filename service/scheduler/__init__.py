"""Inter-task scheduler: CP-SAT planner (planner, with problem, encode, warm_start, quotas, cp,
objective, packing), duration/GPU estimator (estimator), the instance read from the database
(snapshot) and the database loop (loop.replan). The planner imports no database code; loop is
loaded on use."""

from __future__ import annotations

from typing import Any

__all__ = ["current_plan", "last_plan_info", "replan"]


def __getattr__(name: str) -> Any:
    # Lazy so the pure planner (and the benchmark) import without SQLAlchemy or Redis.
    if name in __all__:
        from service.scheduler import loop

        return getattr(loop, name)
    raise AttributeError(name)
