"""The browser dashboard, served by the API itself from files shipped in the package."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
