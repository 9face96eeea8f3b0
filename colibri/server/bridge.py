"""From the scheduler's thread to the event loop: the choices of one HTTP request.

`Generation.submit` hands every choice of a request (prompts x n) to one Engine's
Scheduler, all or none: if the queue refuses one, the ones already queued are cancelled
and QueueFullError / ContextLengthError / ValueError reach the route. The scheduler calls
on_event from its thread; the event goes onto an asyncio.Queue of the request's loop with
call_soon_threadsafe, so the routes only ever await. `cancel()` (a client gone, a stream
closed) frees the slots at the scheduler's next step.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ..batching import RequestHandle, SamplingParams, TokenEvent
from .engine import Engine

__all__ = ["Generation", "wait_disconnect"]


class Generation:
    """The running choices of one request on one engine; events merged as (index, event)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.handles: list[RequestHandle] = []
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
        """Queue every (prompt ids, params) job, choice index = its position."""
        gen = cls(engine)
        try:
            for i, (ids, params) in enumerate(jobs):
                gen.handles.append(engine.scheduler.submit(ids, params, gen._on_event(i)))
                gen._open += 1
        except BaseException:
            gen.cancel()
            raise
        return gen

    def cancel(self) -> None:
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
        while self._open:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._open -= sum(ev.finish_reason is not None for _, ev in batch)
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
