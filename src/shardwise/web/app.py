"""FastAPI application: the tool API (`tools.py`), the explainers' API (`learn.py`), the pages,
the API docs (`/docs`, served offline) and a 404 page.

Every request/response is a pydantic model; a `ShardwiseError` (bad input the CLI would reject
with exit code 2) becomes HTTP 400 with the same one-line message in `detail`. An unknown path
outside `/api/` is the 404 page with the navigation; under `/api/` a JSON error.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardwise.errors import ShardwiseError

STATIC = Path(__file__).parent / "static"


def create_app() -> FastAPI:
    """The FastAPI application: the tool and explainer APIs, the pages, one-line 400s for
    `ShardwiseError`."""
    from importlib.metadata import version

    from fastapi_offline import FastAPIOffline

    from shardwise.web import learn, tools

    # /docs and /redoc with Swagger UI and ReDoc served from the fastapi-offline package: the
    # API docs work with no network
    app = FastAPIOffline(title="shardwise", version=version("shardwise"),
                         description="Plan, simulate and learn distributed training of "
                                     "Transformers.",
                         favicon_url="/static/favicon.svg", static_url="/static-docs")

    @app.exception_handler(ShardwiseError)
    async def bad_input(_: Request, exc: ShardwiseError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def not_found(request: Request, exc: StarletteHTTPException) -> Response:
        """An unknown page is a 404 page with the navigation; the API keeps JSON errors."""
        if exc.status_code == 404 and not request.url.path.startswith("/api/"):
            return FileResponse(STATIC / "404.html", status_code=404)
        return await http_exception_handler(request, exc)

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
