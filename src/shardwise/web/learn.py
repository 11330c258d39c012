"""`/api/learn/*`: the explainers' data, computed by the emulations and the analytic models."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["learn"])
