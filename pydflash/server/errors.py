"""Errors in each API's own shape: OpenAI `{"error": {...}}`, Anthropic `{"type": "error", "error": {...}}`.

Routes raise `APIError(status, message, param=...)`; the app renders it in the shape of the API the request
was addressed to (paths under /v1/messages are Anthropic's, everything else OpenAI's).
"""
from __future__ import annotations

from starlette.responses import JSONResponse

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    503: ("server_overloaded", "overloaded_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(error: APIError, anthropic: bool) -> dict:
    openai_type, anthropic_type = _TYPES.get(error.status, ("server_error", "api_error"))
    if anthropic:
        return {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    return {"error": {"message": error.message, "type": openai_type, "param": error.param, "code": error.code}}


def error_response(error: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(error, is_anthropic_path(path)), status_code=error.status, headers=error.headers)
