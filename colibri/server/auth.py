"""The api key: `Authorization: Bearer KEY`, compared in constant time, before anything else.

Without a key (the default, allowed on loopback only unless --insecure) every route is open.
With one, every route but /health (probed by load balancers) and the static files of the web
page (webui.WEBUI_PATHS, when it is on: the page asks for the key and sends it on every API
call) needs it: a missing or wrong key gets 401 with WWW-Authenticate: Bearer and the OpenAI
error body, before the body is read.
"""
from __future__ import annotations

import hmac
import json

from .errors import error_body

__all__ = ["KeyGuard", "OPEN_PATHS", "key_matches"]

OPEN_PATHS = frozenset({"/health"})


def key_matches(header: bytes | None, key: str) -> bool:
    """Whether an Authorization header value presents `key` as a bearer token."""
    if header is None:
        return False
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest: the time taken does not depend on where the token differs from the key
    return hmac.compare_digest(token.strip().encode("latin-1"), key.encode())


class KeyGuard:
    """ASGI middleware: 401 for every http request outside OPEN_PATHS without the key."""

    def __init__(self, app, key: str | None, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.key, self.open_paths = app, key, open_paths

    async def __call__(self, scope, receive, send):
        if (self.key is None or scope["type"] != "http" or scope["path"] in self.open_paths
                or key_matches(dict(scope["headers"]).get(b"authorization"), self.key)):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(401, "A valid api key is required: send the header "
                                          "'Authorization: Bearer <key>'.",
                                     code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
