"""ASGI middleware of the server: the API key check and the request body limit, both answering
before a body is read whole."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from expertmesh.entrypoints.api_errors import error_response


class ApiKey:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>`, on every route but the open ones."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.OPEN:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):  # the key itself is never logged
            response = error_response(
                401, "a valid API key is required: Authorization: Bearer <key>", None, "invalid_api_key"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, by its Content-Length or as it streams in."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            status = 413 if declared.isdigit() else 400
            return await error_response(status, self._message(declared.decode(errors="replace")))(
                scope, receive, send
            )
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # a chunked body without a length: stop reading it here
                raise HTTPException(413, self._message(f"more than {self.limit}"))
            return message

        await self.app(scope, limited, send)

    def _message(self, size: str) -> str:
        return f"the request body ({size} bytes) exceeds max_request_body_bytes={self.limit}"
