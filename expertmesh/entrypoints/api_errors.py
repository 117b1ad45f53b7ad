"""OpenAI's error body, {"error": {message, type, param, code}}, for every failure of a request:
`APIError` (raised by the request mapping and the routes) and the handlers that turn every
exception a route can raise (pydantic's 422, HTTP errors, a dead engine) into that body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertmesh.entrypoints import structured_api
from expertmesh.entrypoints.async_engine import EngineDead
from expertmesh.entrypoints.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    def handler(
        status: int, param: str | None = None, code: str | None = None
    ) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
        async def handle(_: Request, exc: Exception) -> JSONResponse:
            return error_response(status, str(exc), param, code)

        return handle

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None)

    async def field_error(_: Request, exc: structured_api.APIFieldError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, "invalid_value")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(structured_api.APIFieldError, field_error)  # structured outputs hook
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDead, handler(503, code="engine_dead"))


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's 422 becomes OpenAI's 400, naming the first bad field."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {err.get('msg')}", None, "invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":  # no field is silently dropped
        return error_response(400, f"unknown field {where!r}", loc[0] if loc else None, "unknown_parameter")
    return error_response(400, f"{where}: {err.get('msg')}", loc[0] if loc else None, "invalid_value")
