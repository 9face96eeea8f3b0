"""`colibri serve --workers N`: N server processes behind one port, over one copy of the model
in memory.

    run_workers(settings, workers=4)      # returns the exit status when all have stopped

The parent (a supervisor that serves nothing itself):
- maps the model file (colibri.open: the header, tensor table and metadata checked and
  parsed once, a clear error before any process starts); it never runs a kernel, so no
  thread pool exists when it forks;
- creates the listening socket and forks the workers; each worker inherits the socket and
  the mapping, builds its Model and Scheduler from that mapping after the fork
  (ModelHolder(settings, file=...)) and runs the ordinary server on the socket
  (`serve(settings, sockets=[sock], app=...)`). The kernel hands each connection to
  whichever worker's event loop accepts it first (one accept queue). Measured against one
  SO_REUSEPORT socket per worker (docs/serving.md): the same spread over the workers, for
  one client or several; chosen because with one queue the connections waiting for a worker
  that dies are accepted by the others (SO_REUSEPORT resets them), and a worker restarting
  (loading its model) takes no connection before it can serve. Responses carry the
  answering worker's pid in the X-Colibri-Worker header;
- forwards SIGHUP / SIGUSR1 to every worker (each reloads the model file as a single server
  does) and then drops its own mapping: a worker started after a reload maps the file at
  the path itself, the one the others reloaded; on SIGTERM / SIGINT it stops them all
  (SIGTERM; SIGKILL after `grace` seconds);
- restarts a worker that dies, with a log line naming its pid and status; workers that keep
  dying within MIN_UPTIME seconds of their start make the supervisor stop all and exit with
  status 1 (a server that cannot start is not restarted forever);
- writes --pid-file with its own pid (the one to signal) and removes it at exit.

Without --threads each worker runs cores / N kernel threads (at least 1): N workers with
all cores each would oversubscribe the machine.

Why the workers inherit the parent's mapping rather than each mapping the file: the weights
are in memory once either way (every mapping of the file, inherited or not, points at the
same page-cache pages), but what the parent parsed before the fork (tensor table, metadata,
tokenizer JSON) stays shared copy-on-write instead of being built again in each worker:
measured, 4-7 MB less PSS per worker (docs/serving.md, scripts/measure_workers.py).
"""
from __future__ import annotations

import logging
import logging.config
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import replace

from ..format import ColibriFile
from ..kernels.runtime import default_threads
from .app import create_app
from .engine import ModelHolder
from .run import log_config, serve
from .settings import Settings

__all__ = ["run_workers", "listening_socket", "WorkerHeader", "WORKER_HEADER", "MIN_UPTIME"]

log = logging.getLogger("colibri.server.workers")

MIN_UPTIME = 10.0        # seconds: a worker dying sooner than this after its start failed
MAX_FAILED_STARTS = 3    # consecutive failed starts after which the supervisor gives up
_FORWARDED = (signal.SIGHUP, signal.SIGUSR1)
WORKER_HEADER = "X-Colibri-Worker"
_STOPPING = (signal.SIGTERM, signal.SIGINT)


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A bound, listening TCP socket the workers inherit (IPv6 when host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


class WorkerHeader:
    """ASGI middleware: every HTTP response names the process that answered it
    (X-Colibri-Worker: <pid>), so a client can see how requests spread over workers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        pid = str(os.getpid()).encode()

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()),
                                                 (WORKER_HEADER.lower().encode(), pid)])
            await send(message)
        await self.app(scope, receive, send_named)


def _worker_main(settings: Settings, sock: socket.socket, file: ColibriFile | None) -> int:
    """What a forked worker runs: the ordinary server over the inherited mapping (or, with
    file None, over its own mapping of the path) on the inherited socket."""
    try:
        app = create_app(settings, ModelHolder(settings, file=file))
        app.add_middleware(WorkerHeader)
        serve(settings, sockets=[sock], app=app)
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


class Supervisor:
    """The parent of `workers` forked server processes; see the module docstring."""

    def __init__(self, settings: Settings, workers: int, grace: float = 30.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.settings, self.workers, self.grace = settings, workers, grace
        self.children: dict[int, float] = {}       # pid -> start time (monotonic)
        self.failed_starts = 0
        self.stopping: float | None = None         # monotonic time SIGTERM was forwarded
        self.status = 0
        self.sock: socket.socket | None = None
        self.file: ColibriFile | None = None       # inherited by workers until a reload

    # -- processes -----------------------------------------------------------------------

    def _spawn(self) -> None:
        child_settings = replace(self.settings, pid_file=None)
        sys.stdout.flush()
        sys.stderr.flush()
        # Blocked across the fork: a signal must not reach the child's copy of the parent's
        # handlers (it would signal its siblings); the child resets them, then unblocks.
        signals = {*_FORWARDED, *_STOPPING}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            pid = os.fork()
            if pid == 0:                           # the worker
                code = 1
                try:
                    for sig in signals:
                        signal.signal(sig, signal.SIG_DFL)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
                    code = _worker_main(child_settings, self.sock, self.file)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        self.children[pid] = time.monotonic()
        log.info("worker %d started", pid)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            started = self.children.pop(pid, None)
            if started is None:
                continue
            how = (f"signal {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
                   if os.WIFSIGNALED(status) else f"status {os.waitstatus_to_exitcode(status)}")
            if self.stopping is not None:
                log.info("worker %d stopped (%s)", pid, how)
                continue
            uptime = time.monotonic() - started
            self.failed_starts = self.failed_starts + 1 if uptime < MIN_UPTIME else 0
            if self.failed_starts >= MAX_FAILED_STARTS:
                log.error("worker %d exited with %s %.1f s after its start; %d workers in a "
                          "row died within %.0f s of starting: stopping", pid, how, uptime,
                          self.failed_starts, MIN_UPTIME)
                self.status = 1
                self._stop(signal.SIGTERM)
                continue
            log.warning("worker %d exited with %s after %.1f s; starting another", pid, how,
                        uptime)
            self._spawn()

    def _signal_all(self, sig: int) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # -- signals -------------------------------------------------------------------------

    def _forward(self, sig: int, frame=None) -> None:
        log.info("%s: forwarded to %d workers", signal.Signals(sig).name, len(self.children))
        self._signal_all(sig)
        if self.file is not None:        # workers started from now on map the path
            self.file.close()
            self.file = None

    def _stop(self, sig: int, frame=None) -> None:
        if self.stopping is None:
            log.info("%s: stopping %d workers", signal.Signals(sig).name, len(self.children))
            self.stopping = time.monotonic()
            self._signal_all(signal.SIGTERM)

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        self.settings.check()
        # Opened here, once: a bad file is one clear error, not N dying workers.
        self.file = ColibriFile(self.settings.model_path())
        self.sock = listening_socket(self.settings.host, self.settings.port)
        old = {s: signal.getsignal(s) for s in (*_FORWARDED, *_STOPPING)}
        pid_file = self.settings.pid_file
        try:
            for s in _FORWARDED:
                signal.signal(s, self._forward)
            for s in _STOPPING:
                signal.signal(s, self._stop)
            if pid_file:
                with open(pid_file, "w", encoding="ascii") as f:
                    f.write(f"{os.getpid()}\n")
            host, port = self.sock.getsockname()[:2]
            log.info("supervisor %d: %d workers on http://%s:%d", os.getpid(), self.workers,
                     host, port)
            for _ in range(self.workers):
                self._spawn()
            while self.children:
                self._reap()
                if self.stopping is not None and time.monotonic() - self.stopping > self.grace:
                    log.warning("workers %s still running %.0f s after SIGTERM: killing them",
                                sorted(self.children), self.grace)
                    self._signal_all(signal.SIGKILL)
                    self.stopping = time.monotonic()
                time.sleep(0.05)
        finally:
            self._stop(signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while self.children and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.05)
            self._signal_all(signal.SIGKILL)
            for pid in list(self.children):
                os.waitpid(pid, 0)
            for s, h in old.items():
                signal.signal(s, h)
            self.sock.close()
            if self.file is not None:
                self.file.close()
            if pid_file:
                try:
                    os.unlink(pid_file)
                except FileNotFoundError:
                    pass
        return self.status


def run_workers(settings: Settings, workers: int, grace: float = 30.0) -> int:
    """Serve `settings` from `workers` processes behind one port; the exit status when all
    have stopped (0 after SIGTERM/SIGINT, 1 when workers could not start)."""
    logging.config.dictConfig(log_config(settings))     # the workers' log format
    if settings.threads is None:
        # each worker its share of the cores: N workers x all cores oversubscribe them
        settings = replace(settings, threads=max(1, default_threads() // workers))
        log.info("%d kernel threads per worker (--threads to choose)", settings.threads)
    return Supervisor(settings, workers, grace).run()
