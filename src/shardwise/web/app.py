"""FastAPI application: the tool API (`tools.py`), the explainers' API (`learn.py`), the pages,
the API docs (`/docs`, served offline) and a 404 page.

Every request/response is a pydantic model; a `ShardwiseError` (bad input the CLI would reject
with exit code 2) becomes HTTP 400 with the same one-line message in `detail` (and, for a
`tools.FieldError`, the form field at fault in `field`). An unknown path
outside `/api/` is the 404 page with the navigation; under `/api/` a JSON error. A request that
fails validation is a 422 whose echo of the input is always JSON (NaN, Infinity or 1e400 in a
body are shown as text, never break the answer into a 500); a result that is not a finite
number is a 422 too (`validate.finite_result` refuses most of them first). A page name longer
than any page is a 404 before it touches the file system.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardwise.errors import ShardwiseError, one_line
from shardwise.validate import walk

STATIC = Path(__file__).parent / "static"
MAX_PAGE_NAME = 64  # the longest page name is ~20 characters
_NOT_JSON = "Out of range float values are not JSON compliant"  # json.dumps(allow_nan=False)


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
        field = getattr(exc, "field", None)  # tools.FieldError: the form field at fault
        return JSONResponse({"detail": one_line(exc)} | ({"field": field} if field else {}),
                            status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))},
                            status_code=422)

    @app.exception_handler(ValueError)
    async def not_finite(request: Request, exc: ValueError) -> JSONResponse:
        if _NOT_JSON not in str(exc):  # a bug, not an answer: the usual 500
            raise exc
        return JSONResponse({"detail": "the inputs give a result that is not a finite number "
                                       "(nan or inf); use smaller or less extreme values"},
                            status_code=422)

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
    if (len(name) > MAX_PAGE_NAME or not name.replace("-", "").isalnum()
            or not (folder / f"{name}.html").is_file()):
        raise HTTPException(404, f"no page {name[:MAX_PAGE_NAME]!r}")
    return FileResponse(folder / f"{name}.html")


def _json_safe(value: Any) -> Any:
    """`value` with every nan or ±inf replaced by its text ("nan", "inf")."""
    if any(isinstance(v, float) and not math.isfinite(v) for _, v, _ in walk(value)):
        if isinstance(value, dict):
            return {k: _json_safe(v) for k, v in value.items()}
        if isinstance(value, list):
            return [_json_safe(v) for v in value]
        return str(value)
    return value
