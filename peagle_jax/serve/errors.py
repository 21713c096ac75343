"""OpenAI-style errors: every failure, ours or the framework's, reaches the client as
`{"error": {message, type, param, code}}` so OpenAI clients raise their typed exceptions."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("peagle_jax.serve")

__all__ = ["APIError", "ErrorBody", "ErrorDetail", "register_exception_handlers", "validation_to_error"]

# Names pydantic puts into a location for union branches ("str", "list[int]"); they are no field.
_UNION_BRANCH_NAMES = ("str", "int", "float")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail

    @classmethod
    def of(cls, message: str, type: str, param: str | None = None, code: str | None = None) -> ErrorBody:
        return cls(error=ErrorDetail(message=message, type=type, param=param, code=code))


class APIError(Exception):
    """Raised anywhere in a request to answer with this status and error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody.of(self.message, self.type, self.param, self.code)


def _json(body: ErrorBody, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def validation_to_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 that names the bad field the way the client spelled it."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                        code="invalid_json")
    if err.get("type") == "missing" and not loc:
        return APIError(400, "request body is missing or is not a JSON object", code="invalid_json")
    param = ".".join(x for x in loc if not x.isdigit() and "[" not in x and x not in _UNION_BRANCH_NAMES)
    param = param or None
    msg = err.get("msg", "invalid value")
    code = "invalid_value" if err.get("type") != "missing" else "missing_required_parameter"
    return APIError(400, f"{param or 'body'}: {msg}", param=param, code=code)


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    # RFC 7235: a 401 names the scheme the client should use.
    headers = dict(exc.headers or {})
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _json(exc.body(), exc.status, headers or None)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await api_error_handler(request, validation_to_error(exc))


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
    return _json(ErrorBody.of(str(exc.detail), kind, None, code), exc.status_code)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # The log gets the traceback; the client only the exception's type, never its text.
    log.exception("unhandled error")
    return _json(ErrorBody.of(f"internal error: {type(exc).__name__}", "server_error"), 500)


def register_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
