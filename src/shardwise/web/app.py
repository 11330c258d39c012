"""FastAPI application: the tool API (`tools.py`), the explainers' API (`learn.py`), the pages.

Every request/response is a pydantic model; a `ShardwiseError` (bad input the CLI would reject
with exit code 2) becomes HTTP 400 with the same one-line message in `detail`.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from shardwise.errors import ShardwiseError

STATIC = Path(__file__).parent / "static"


def create_app() -> FastAPI:
    """The FastAPI application: the tool and explainer APIs, the pages, one-line 400s for
    `ShardwiseError`."""
    from importlib.metadata import version

    from shardwise.web import learn, tools

    app = FastAPI(title="shardwise", version=version("shardwise"),
                  description="Plan, simulate and learn distributed training of Transformers.")

    @app.exception_handler(ShardwiseError)
    async def bad_input(_: Request, exc: ShardwiseError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    app.add_middleware(tools.LimitBody)
    app.include_router(tools.router, prefix="/api")
    app.include_router(learn.router, prefix="/api/learn")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/learn/{widget}", include_in_schema=False)
    def learn_page(widget: str) -> FileResponse:
        return _page(STATIC / "learn", widget)

    @app.get("/{page}", include_in_schema=False)
    def tool_page(page: str) -> FileResponse:
        return _page(STATIC, page)

    return app


def _page(folder: Path, name: str) -> FileResponse:
    """`/planner` → static/planner.html; names are checked so no path escapes the folder."""
    if not name.replace("-", "").isalnum() or not (folder / f"{name}.html").is_file():
        raise HTTPException(404, f"no page {name!r}")
    return FileResponse(folder / f"{name}.html")
