"""The ASGI app: routes, errors in each API's shape, the chat page at `/`."""
from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import anthropic_api, openai_api
from .errors import APIError, error_response
from .state import ServerState

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")


async def health(request):
    return JSONResponse(request.app.state.server.health())


async def page(request):
    return FileResponse(os.path.join(STATIC_DIR, "index.html"))


async def _api_error(request, exc: APIError):
    return error_response(exc, request.url.path)


async def _http_error(request, exc: HTTPException):
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})), request.url.path)


async def _server_error(request, exc: Exception):
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


def create_app(engine, *, alias: str | None = None, api_key: str | None = None, queue_size: int = 16,
               target_path: str | None = None) -> Starlette:
    """An app serving `engine` (a pydflash.Engine). Run it with any ASGI server; `pydflash serve` uses uvicorn."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", openai_api.models, methods=["GET"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
        Route("/", page, methods=["GET"]),
        Mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui"),
    ]
    app = Starlette(routes=routes,
                    middleware=[Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                                           allow_headers=["*"])],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.server = ServerState(engine, alias=alias, api_key=api_key, queue_size=queue_size,
                                   target_path=target_path)
    return app
