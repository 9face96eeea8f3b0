"""From the scheduler's thread to the event loop: the choices of one HTTP request.

`Generation.submit` hands the choices of a request (prompts x n) to one Engine's
Scheduler: as many as its queue takes at once, the rest as the request's own choices finish
(a request of more choices than slots + queue is served in turn, never refused for its
size). Every choice is checked against the scheduler's context and KV budget first, so
ContextLengthError / ValueError reach the route before anything runs, and QueueFullError
when the queue takes not even the first choice (429). The scheduler calls
on_event from its thread; the event goes onto an asyncio.Queue of the request's loop with
call_soon_threadsafe, so the routes only ever await. `cancel()` (a client gone, a stream
closed) frees the slots at the scheduler's next step.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence

from ..generation.batching import ContextLengthError, QueueFullError, RequestHandle, TokenEvent
from ..generation.sampling import SamplingParams
from .engine import Engine

log = logging.getLogger("colibri.server")
_RETRY_SECONDS = 0.05          # a request with choices waiting and none running polls the queue

__all__ = ["Generation", "wait_disconnect"]


class Generation:
    """The running choices of one request on one engine; events merged as (index, event)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.handles: list[RequestHandle] = []        # the submitted ones, in choice order
        self._pending: deque[tuple[int, tuple[list[int], SamplingParams]]] = deque()
        self._queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._open = 0

    def _on_event(self, index: int):
        loop, q = self._loop, self._queue

        def deliver(ev: TokenEvent) -> None:       # scheduler thread
            loop.call_soon_threadsafe(q.put_nowait, (index, ev))
        return deliver

    @classmethod
    def submit(cls, engine: Engine, jobs: Sequence[tuple[list[int], SamplingParams]]
               ) -> "Generation":
        """Queue the (prompt ids, params) jobs, choice index = its position: all that the
        queue takes now, the others as choices of this request finish (batches())."""
        sched = engine.scheduler
        for ids, params in jobs:                   # what submit would refuse, before any runs
            params.check()
            need = len(ids) + params.max_tokens
            if need > sched.ctx or need * sched.kv_bytes_per_token > sched.kv_budget:
                raise ContextLengthError(
                    f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                    f"{need} tokens do not fit the context of {sched.ctx} tokens and the KV "
                    f"budget of {sched.kv_budget // sched.kv_bytes_per_token} tokens")
        gen = cls(engine)
        gen._pending.extend(enumerate(jobs))
        try:
            gen._top_up(first=True)
        except BaseException:
            gen.cancel()
            raise
        return gen

    def _top_up(self, first: bool = False) -> None:
        """Submit waiting jobs until the scheduler's queue refuses one (first: re-raise that
        QueueFullError when it refuses the request's very first job: a 429)."""
        while self._pending:
            i, (ids, params) = self._pending[0]
            try:
                handle = self.engine.scheduler.submit(ids, params, self._on_event(i))
            except QueueFullError:
                if first and not self.handles:
                    raise
                return
            self._pending.popleft()
            self.handles.append(handle)
            self._open += 1

    def cancel(self) -> None:
        self._pending.clear()
        for h in self.handles:
            if h.finish_reason is None:
                h.cancel()

    @property
    def prompt_tokens(self) -> int:
        return sum(h.prompt_tokens for h in self.handles)

    @property
    def completion_tokens(self) -> int:
        return sum(h.completion_tokens for h in self.handles)

    async def batches(self) -> AsyncIterator[list[tuple[int, TokenEvent]]]:
        """[(choice index, event), ...]: every event there is when the loop gets to it (at
        least one), until every choice has had its last event. A stream writes each batch
        at once: one write per batch, not per token, when the engine is ahead."""
        while self._open or self._pending:
            if not self._open:                     # choices waiting, none of ours running
                self._top_up()
                if not self._open:
                    await asyncio.sleep(_RETRY_SECONDS)
                    continue
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            finished = sum(ev.finish_reason is not None for _, ev in batch)
            self._open -= finished
            if finished and self._pending:
                self._top_up()
            yield batch

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(choice index, event) as they come, until every choice has had its last event."""
        async for batch in self.batches():
            for item in batch:
                yield item


async def wait_disconnect(receive) -> None:
    """Return when the client has gone (the ASGI http.disconnect message)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
