"""serve(): uvicorn in this process, with the reload signals and the pid file.

    serve(settings)                       # binds settings.host:settings.port
    serve(settings, sockets=[sock])       # or serves sockets bound (and shared) by a parent

SIGHUP and SIGUSR1 reload the model file (ModelHolder.reload, in a thread: the loop keeps
serving while the new file is read and checked); SIGINT / SIGTERM stop the server
(uvicorn's own handlers): requests in flight are cancelled, the pid file removed, and
serve() returns.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

import uvicorn
import uvicorn.config
from fastapi import FastAPI

from .app import create_app
from .engine import ModelHolder
from .settings import Settings

__all__ = ["serve", "RELOAD_SIGNALS", "PidFile"]

log = logging.getLogger("colibri.server")

RELOAD_SIGNALS = (signal.SIGHUP, signal.SIGUSR1)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)         # uvicorn's: a graceful shutdown


class PidFile:
    """Writes this process's id to `path` on enter (temp file + rename), removes it on exit
    if it still holds this id (a later server may have taken the name)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None

    def __enter__(self) -> "PidFile":
        if self.path is not None:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{os.getpid()}\n")
            os.replace(tmp, self.path)
        return self

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        try:
            if self.path.read_text().strip() == str(os.getpid()):
                self.path.unlink()
        except OSError:
            pass


def install_reload_signals(app: FastAPI) -> None:
    """SIGHUP / SIGUSR1 -> app.state.reload() on the running loop (main thread only)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def on_signal(sig: signal.Signals) -> None:
        task = loop.create_task(app.state.reload(f"signal {sig.name}"))
        tasks.add(task)                      # keep a reference until it is done
        task.add_done_callback(tasks.discard)
    for sig in RELOAD_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)


def log_config(settings: Settings) -> dict:
    """uvicorn's logging setup, with colibri's loggers (reloads, refused files) on its
    stderr handler."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["colibri"] = {"handlers": ["default"], "level": settings.log_level.upper(),
                                    "propagate": False}
    return config


def serve(settings: Settings, sockets: Sequence[socket.socket] | None = None,
          holder: ModelHolder | None = None, app: FastAPI | None = None) -> None:
    """Run the server until SIGINT / SIGTERM. settings.check() first (the loopback rule).

    sockets: already-bound listening sockets to serve instead of binding host:port (a
    pre-fork parent binds once and hands them to every worker). holder / app: a ModelHolder
    (e.g. over a file the parent mapped) or a whole app made with create_app; by default one
    is made from settings. Reload signals are installed when running in the main thread.
    """
    settings.check()
    app = app if app is not None else create_app(settings, holder)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, log_config=log_config(settings),
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    main_thread = threading.current_thread() is threading.main_thread()

    async def main() -> None:
        if main_thread:
            install_reload_signals(app)
        await server.serve(sockets=list(sockets) if sockets else None)

    # uvicorn raises the stop signal again once it has shut down (to die of it); with this
    # no-op handler in place that returns here instead, so the pid file is removed and the
    # command exits 0 after a clean shutdown
    saved = {sig: signal.signal(sig, _stopped) for sig in STOP_SIGNALS} if main_thread else {}
    try:
        with PidFile(settings.pid_file):
            asyncio.run(main())
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _stopped(signum, frame) -> None:
    """The stop signal, raised again by uvicorn after its shutdown: already handled."""
