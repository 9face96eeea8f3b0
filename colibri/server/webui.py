"""The page at `/` of `colibri serve`: a chat with a live view of the routing (docs/serving.md).

    register_webui(app)          # GET /, /webui/app.js, /webui/routing.js, /webui/style.css

The page is three static files shipped in the package (colibri/server/webui/), read once and
served as they are: no build step, nothing fetched from elsewhere (the Content-Security-Policy
header forbids it, so a stray external URL would fail in the browser too). The page talks to
the server only through the public API: /v1/models, then /v1/chat/completions (or
/v1/completions for a model without a chat template) with stream: true and the routing
extension. The files themselves hold no model data, so they are open like /health; with
--api-key the page asks for the key and sends it as a bearer token, and every API call it
makes is refused without it (WEBUI_PATHS are the only paths KeyGuard lets through for it).
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

__all__ = ["register_webui", "WEBUI_PATHS", "WEBUI_FILES", "CSP"]

# path -> (file in colibri/server/webui/, media type)
WEBUI_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/routing.js": ("routing.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}
WEBUI_PATHS = frozenset(WEBUI_FILES)

# only this server: scripts, styles and API calls ('self'); the favicon is an inline data: URL
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("webui", name).read_bytes()


def register_webui(app: FastAPI) -> None:
    """Add GET routes for WEBUI_FILES to app (kept out of the OpenAPI document)."""
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}
    def route(body: bytes, media_type: str):
        async def page() -> Response:
            return Response(body, media_type=media_type, headers=headers)
        return page

    for path, (name, media_type) in WEBUI_FILES.items():
        # read at start: a file missing from an install fails the app, not a request
        app.add_api_route(path, route(_read(name), media_type), methods=["GET"],
                          include_in_schema=False)
