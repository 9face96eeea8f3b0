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
    app.py        create_app: the routes
    run.py        serve: uvicorn in-process, reload signals, pid file
"""
from .settings import Settings, is_loopback, parse_bytes
from .engine import Engine, ModelHolder, ReloadResult
from .app import VERSION_HEADER, create_app
from .run import serve

__all__ = ["Settings", "parse_bytes", "is_loopback", "Engine", "ModelHolder", "ReloadResult",
           "create_app", "serve", "VERSION_HEADER"]
