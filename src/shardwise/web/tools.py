"""`/api/models`, `/api/memory`, `/api/comm`, `/api/schedule`, `/api/plan`."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["tools"])
