"""The body size limit, as ASGI middleware: 413 before any route sees a body past --max-body.

A Content-Length over the limit is refused at once; any other body (chunked) is read as it
arrives, up to the limit, and refused when it passes it. A body within the limit is handed
to the app as one message; later receives (the disconnect a streaming response listens
for) go to the server as usual.
"""
from __future__ import annotations

import json

from .errors import error_body

__all__ = ["BodyLimit"]


class BodyLimit:
    """ASGI middleware: `app` wrapped so that no request body over max_body bytes reaches it."""

    def __init__(self, app, max_body: int):
        self.app, self.max_body = app, max_body

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(413, f"The request body is larger than the limit of "
                                          f"{self.max_body} bytes (--max-body).",
                                     code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._refuse(send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":      # the client left before sending it all
                return await self.app(scope, _replay([message], receive), send)
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.max_body:
                return await self._refuse(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[dict], receive):
    """A receive that returns `messages` first, then defers to the server's."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed
