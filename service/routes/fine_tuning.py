"""OpenAI-compatible fine-tuning API (/v1/fine_tuning/jobs, /v1/models/{id}): a fine-tuning job is
a loraplex task seen through the shapes of OpenAI's API."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
