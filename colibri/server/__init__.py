"""The OpenAI-compatible HTTP server of `colibri serve` (the `server` extra: fastapi, pydantic,
uvicorn, prometheus-client). docs/server.md documents the routes and flags.

    from colibri.server import Settings, create_app, serve
    serve(Settings(model="model.colibri", parallel=4))       # blocks; SIGHUP reloads

The modules, in data-flow order:
    settings.py   Settings: every flag, checked once (the loopback / api-key rule)
    engine.py     ModelHolder: the Engine (Model + batching.Scheduler) serving now; hot reload
    schemas.py    the request bodies (pydantic): every field's range
    auth.py       the api key (ASGI middleware, constant-time compare)
    limits.py     the body size limit (ASGI middleware, 413)
    errors.py     the OpenAI error body and the status of each failure
    bridge.py     a request's choices on the scheduler, events onto the event loop
    responses.py  the response bodies and stream chunks (logprobs in both shapes, extension)
    metrics.py    /metrics (prometheus-client) and the request counter
    webui.py      the page at / (static files in webui/: chat and the live routing)
    app.py        create_app: the routes
    run.py        serve: uvicorn in-process, reload signals, pid file
"""
import importlib

from .settings import Settings, is_loopback, parse_bytes

__all__ = ["Settings", "parse_bytes", "is_loopback", "Engine", "ModelHolder", "ReloadResult",
           "create_app", "serve", "VERSION_HEADER"]

# The names below need the server extra (fastapi, uvicorn, ...): imported on first use, so
# that `colibri.server.settings` (and the CLI's argument parsing) works without it.
_LAZY = {"Engine": "engine", "ModelHolder": "engine", "ReloadResult": "engine",
         "create_app": "app", "VERSION_HEADER": "app", "serve": "run"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
