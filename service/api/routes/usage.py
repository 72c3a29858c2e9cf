"""Route /v1/usage: the calling tenant's training usage and cost over a period (service.usage)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service import usage
from service.api.deps import SessionDep, SettingsDep, TenantDep
from service.api.error_docs import errors
from service.models import utcnow

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", response_model=usage.UsageReport, responses=errors(401, 422))
def get_usage(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
              start: Annotated[usage.Instant, Query(description="Period start, inclusive: ISO "
                                                    "8601 (UTC when no offset), a date or Unix "
                                                    "seconds.")],
              end: Annotated[usage.Instant | None, Query(description="Period end, exclusive "
                                                         "(default: now), as start.")] = None,
              ) -> usage.UsageReport:
    """Tokens trained, GPU-seconds and cost of the tenant's tasks in [start, end), per task: each
    training step counts in the period it was reported in."""
    return usage.usage_report(session, tenant, start, end or utcnow(),
                              settings.price_per_gpu_hour)
