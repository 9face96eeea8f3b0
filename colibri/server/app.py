"""create_app: the FastAPI application of `colibri serve` (the routes of docs/server.md).

    app = create_app(settings)                      # opens the model file named in settings
    app = create_app(settings, holder=holder)       # or serves an existing ModelHolder

The app starts the holder's scheduler thread in its lifespan and stops it at shutdown;
`app.state.holder` is the ModelHolder, `app.state.reload()` the coroutine that reloads the
model (signals and POST /admin/reload call it). Around the routes, outermost first: request
counting (metrics), the api key (auth), the body size limit (limits); inside, pydantic checks
every field (schemas) and the routes check what depends on the model (vocabulary, context,
chat template) before anything is queued. The page at / (webui.py) is static files that
use the same API; --no-webui leaves it out.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..generation.batching import ContextLengthError, QueueFullError
from ..generation.sampling import SEED_LIMIT, SamplingParams
from ..version import __version__
from .auth import OPEN_PATHS, KeyGuard
from .best_of import choose_best
from .bridge import Generation, wait_disconnect
from .echo import add_echo
from .engine import Engine, ModelHolder, ReloadResult
from .errors import (APIError, context_length_error, error_body, install_error_handlers,
                     queue_full_error)
from .limits import BodyLimit
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .openapi import install_openapi
from .responses import (SSE_DONE, ChoiceState, Envelope, chat_body, chat_chunk, chat_chunks,
                        completion_body, completion_chunk, sse, usage_body, usage_chunk)
from .schemas import ChatCompletionRequest, CompletionRequest, ErrorBody
from .settings import Settings
from .structured import prepare, response_constraint, tool_plan
from .tokenize_routes import register_tokenize_routes
from .webui import WEBUI_PATHS, register_webui

__all__ = ["create_app", "VERSION_HEADER"]

log = logging.getLogger("colibri.server")

VERSION_HEADER = "X-Colibri-Model-Version"
DEFAULT_COMPLETION_TOKENS = 16            # the OpenAI default of /v1/completions


def _errors(*codes: int) -> dict:
    """The OpenAPI `responses` of a route: these statuses answer the error body."""
    return {c: {"model": ErrorBody} for c in codes}


_GENERATION_ERRORS = _errors(400, 401, 404, 413, 422, 429, 500)
_SSE = {"content": {"application/json": {}, "text/event-stream": {}},
        "description": "the response, or with stream: true the SSE chunks ending with "
                       "data: [DONE]"}


class _Route:
    """What the two generation routes share: checks, submission, bodies and streams."""

    def __init__(self, settings: Settings, holder: ModelHolder, metrics: Metrics):
        self.settings, self.holder, self.metrics = settings, holder, metrics
        self.name = settings.served_name()

    # -- checks that depend on the model ------------------------------------------------------
    def check_model(self, requested: str | None) -> None:
        if requested not in (None, "", self.name):
            raise APIError(404, f"The model {requested!r} does not exist here; this server "
                                f"serves {self.name!r} (GET /v1/models).",
                           code="model_not_found", param="model")

    @staticmethod
    def encode(engine: Engine, prompt: str | list[int]) -> list[int]:
        V = engine.model.vocab_size
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise APIError(400, "This model file carries no tokenizer: give the prompt as "
                                    "token ids.", code="no_tokenizer", param="prompt")
            try:
                ids = engine.tokenizer.encode(prompt, verbose=False)
            except Exception as e:                 # noqa: BLE001 - e.g. a lone surrogate
                raise APIError(400, f"The prompt cannot be tokenized: {e}",
                               code="invalid_prompt", param="prompt") from None
        else:
            ids = prompt
            bad = [t for t in ids if t >= V]
            if bad:
                raise APIError(400, f"Token id {bad[0]} is out of the vocabulary [0, {V}).",
                               code="invalid_token_id", param="prompt")
        if not ids:
            raise APIError(400, "The prompt is empty (it encodes to no tokens).",
                           code="empty_prompt", param="prompt")
        return ids

    def defaulted(self, body):
        """The request with serve's sampling defaults (--temp, --top-k, ..., Settings.defaults)
        in the fields it left out; max_tokens is max_tokens_for's."""
        update = {k: v for k, v in self.settings.defaults.items()
                  if k != "max_tokens" and k not in body.model_fields_set}
        return body.model_copy(update=update) if update else body

    def max_tokens_for(self, engine: Engine, asked: int | None, n_prompt: int,
                       fallback: int | None) -> int:
        """What a request asked, else serve's -n, else fallback (None or -1: the rest of
        the context after the n_prompt tokens)."""
        n = asked if asked is not None else self.settings.defaults.get("max_tokens", fallback)
        return max(1, engine.ctx - n_prompt) if n is None or n == -1 else n

    @staticmethod
    def fits(engine: Engine, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > engine.ctx:
            raise context_length_error(engine.ctx, n_prompt, max_tokens)

    @staticmethod
    def params(body, max_tokens: int, logprobs: int | None, choice: int,
               prompt_logprobs: int | None = None, constraint=None) -> SamplingParams:
        seed = None if body.seed is None else (body.seed + choice) % SEED_LIMIT
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
            top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=seed, stop=body.stop_list(), logprobs=logprobs, return_routing=body.routing,
            prompt_logprobs=prompt_logprobs, constraint=constraint)

    def submit(self, engine: Engine, jobs) -> Generation:
        try:
            return Generation.submit(engine, jobs)
        except QueueFullError as e:
            raise queue_full_error(e.retry_after) from None
        except ContextLengthError as e:
            raise APIError(400, str(e), code="context_length_exceeded",
                           param="max_tokens") from None
        except ValueError as e:                    # what the scheduler's own checks refuse
            raise APIError(400, str(e), code="invalid_value") from None

    def states(self, engine: Engine, n: int, logprobs: int | None, body,
               plan=None) -> list[ChoiceState]:
        tok = engine.tokenizer
        text = tok.token_text if tok is not None else (lambda t: f"token_id:{t}")
        ext = body.colibri
        make = plan.state if plan is not None else ChoiceState
        return [make(i, text, logprobs, body.routing, bool(ext and ext.token_ids))
                for i in range(n)]

    def envelope(self, kind: str, engine: Engine, body) -> Envelope:
        return Envelope(kind, self.name, engine.fingerprint, engine.version,
                        list(engine.model.moe_layers), body.colibri is not None)

    # -- answering ----------------------------------------------------------------------------
    def _count(self, gen: Generation, prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.completion_tokens.inc(gen.completion_tokens)

    async def collect(self, gen: Generation, states: list[ChoiceState], request: Request,
                      prompt_tokens: int) -> dict | None:
        """Run every choice to its end; None when the client left first (all cancelled)."""
        async def run():
            async for i, ev in gen.events():
                states[i].add(ev)
                if ev.token >= 0:
                    self.metrics.rate.add()
        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                log.info("client left; cancelling %d choices", len(gen.handles))
                return None
            work.result()
        finally:
            gone.cancel()
            work.cancel()
            gen.cancel()
            self._count(gen, prompt_tokens)
        if any(s.finish_reason == "error" for s in states):
            raise APIError(500, "The engine failed while generating; the error is logged.",
                           code="engine_error")
        return usage_body(prompt_tokens, gen.completion_tokens)

    async def stream(self, gen: Generation, states: list[ChoiceState], env: Envelope,
                     chat: bool, include_usage: bool, prompt_tokens: int):
        """The SSE body: one chunk per event, then usage (if asked) and [DONE]. Closing it
        (a client gone) cancels the choices still running."""
        try:
            if chat:
                for c in states:
                    yield sse(chat_chunk(env, c, None, include_usage))
            failed = False
            async for batch in gen.batches():
                out = []
                for i, ev in batch:
                    c = states[i]
                    offset = c.chars
                    c.add(ev)
                    if ev.finish_reason == "error":
                        out.append(sse(error_body(500, "The engine failed while generating; "
                                                       "the error is logged.",
                                                  code="engine_error")))
                        failed = True
                        break
                    if ev.token >= 0:
                        self.metrics.rate.add()
                    elif not ev.text and ev.finish_reason is None:
                        continue
                    if chat:
                        out.extend(sse(x) for x in chat_chunks(env, c, ev, include_usage))
                    else:
                        out.append(sse(completion_chunk(env, c, ev, offset, include_usage)))
                if out:
                    yield b"".join(out)
                if failed:
                    break
            if include_usage:
                usage = usage_body(prompt_tokens, gen.completion_tokens)
                yield sse(usage_chunk(env, "chat.completion.chunk" if chat else
                                      "text_completion", usage))
            yield SSE_DONE
        finally:
            gen.cancel()
            self._count(gen, prompt_tokens)

    async def answer(self, gen, states, env, body, request, prompt_tokens: int,
                     chat: bool) -> Response:
        headers = {VERSION_HEADER: gen.engine.version}
        if body.stream:
            return StreamingResponse(
                self.stream(gen, states, env, chat, body.include_usage, prompt_tokens),
                media_type="text/event-stream",
                headers=dict(headers, **{"Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no"}))
        usage = await self.collect(gen, states, request, prompt_tokens)
        if usage is None:
            return Response(status_code=499)           # the client left; nobody reads it
        make = chat_body if chat else completion_body
        return JSONResponse(make(env, states, usage), headers=headers)

    async def whole(self, gen, states, env, body, request, prompt_tokens: int, texts,
                    prompts: list[list[int]]) -> Response:
        """The answer of an echo or best_of request: every candidate run to its end, the n
        best of each prompt kept (best_of), the prompt put before them (echo); with stream,
        the chosen choices as one chunk each (echo never streams: schemas)."""
        usage = await self.collect(gen, states, request, prompt_tokens)
        if usage is None:
            return Response(status_code=499)
        k = body.candidates
        chosen = choose_best(states, body.n, k) if k > body.n else states
        out = completion_body(env, chosen, usage)
        if body.echo:
            scored = [gen.handles[p * k].prompt_logprobs for p in range(len(prompts))]
            tok = gen.engine.tokenizer
            add_echo(out, texts, prompts, scored, body.n, body.logprobs, tok,
                     tok.token_text if tok is not None else (lambda t: f"token_id:{t}"),
                     {c.index: c.stop for c in chosen if c.stop is not None})
        headers = {VERSION_HEADER: gen.engine.version}
        if not body.stream:
            return JSONResponse(out, headers=headers)

        def chunks():
            for choice in out["choices"]:
                chunk = env.head("text_completion")
                chunk["choices"] = [choice]
                if body.include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
            if body.include_usage:
                yield sse(usage_chunk(env, "text_completion", usage))
            yield SSE_DONE
        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers=dict(headers, **{"Cache-Control": "no-cache"}))

    # -- the routes ---------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body = self.defaulted(body)
        engine = self.holder.current                  # this request's model version
        texts = body.prompts()
        prompts = [self.encode(engine, p) for p in texts]
        max_tokens = self.max_tokens_for(engine, body.max_tokens, max(map(len, prompts)),
                                         DEFAULT_COMPLETION_TOKENS)
        for ids in prompts:
            self.fits(engine, len(ids), max_tokens)
        k = body.candidates                           # best_of: k candidates, n answered
        logprobs = body.logprobs if body.logprobs is not None or k == body.n else 0
        scored = body.logprobs if body.echo else None  # the prompt's logprobs, once a prompt
        spec = response_constraint(body)
        await prepare(spec, engine)
        jobs = [(ids, self.params(body, max_tokens, logprobs, j, scored if j == 0 else None,
                                  spec))
                for ids in prompts for j in range(k)]
        gen = self.submit(engine, jobs)
        states = self.states(engine, len(jobs), body.logprobs, body)
        env = self.envelope("completion", engine, body)
        n_prompt = sum(len(p) for p in prompts)
        if body.echo or k > body.n:
            return await self.whole(gen, states, env, body, request, n_prompt, texts, prompts)
        return await self.answer(gen, states, env, body, request, n_prompt, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        body = self.defaulted(body)
        engine = self.holder.current
        tok = engine.tokenizer
        if tok is None or not tok.has_chat_template:
            raise APIError(400, f"The model {self.name!r} has no chat template in its file; "
                                f"use /v1/completions with a text prompt.",
                           code="no_chat_template", param="messages")
        plan = tool_plan(body, tok)                   # tools: structured.py
        try:
            ids = tok.apply_chat_template(body.message_dicts(),
                                          tools=plan.template_tools if plan else None)
        except Exception as e:                        # noqa: BLE001 - the template's own error
            raise APIError(400, f"The model's chat template cannot render these messages: "
                                f"{e}", code="chat_template_error", param="messages") from None
        if not ids:
            raise APIError(400, "The messages render to no tokens.", code="empty_prompt",
                           param="messages")
        max_tokens = self.max_tokens_for(engine, body.completion_limit, len(ids), None)
        self.fits(engine, len(ids), max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        spec = plan.constraint if plan else response_constraint(body)
        await prepare(spec, engine)
        jobs = [(ids, self.params(body, max_tokens, logprobs, j, constraint=spec))
                for j in range(body.n)]
        gen = self.submit(engine, jobs)
        states = self.states(engine, body.n, logprobs, body, plan)
        env = self.envelope("chat", engine, body)
        return await self.answer(gen, states, env, body, request, len(ids), chat=True)


def create_app(settings: Settings, holder: ModelHolder | None = None) -> FastAPI:
    """The FastAPI app serving `holder` (default: a ModelHolder opening settings.model_path()).

    Nothing runs until the app's lifespan starts (the scheduler thread starts then), so the
    app can be made before a fork. Signals are not installed here: serve() does that.
    """
    holder = holder if holder is not None else ModelHolder(settings)
    metrics = Metrics(holder)
    routes = _Route(settings, holder, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        holder.start()
        log.info("serving %s (version %s, %d slots of %d tokens)", holder.path,
                 holder.current.version, settings.parallel, holder.current.ctx)
        yield
        holder.stop(drain=False)

    app = FastAPI(title="colibri", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server of a .colibri model (docs/server.md).")
    app.state.settings, app.state.holder, app.state.metrics = settings, holder, metrics

    async def reload(source: str = "api") -> ReloadResult:
        log.info("reload requested (%s)", source)
        return await asyncio.to_thread(holder.reload)
    app.state.reload = reload
    install_error_handlers(app)

    @app.post("/v1/completions", responses={200: _SSE, **_GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        return await routes.completions(body, request)

    @app.post("/v1/chat/completions", responses={200: _SSE, **_GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await routes.chat(body, request)

    register_tokenize_routes(app, routes)        # vLLM's /tokenize, /detokenize, /tokenizer_info

    def model_card() -> dict:
        e = holder.current
        return {"id": routes.name, "object": "model", "created": int(e.loaded_at),
                "owned_by": "colibri",
                "colibri": {"version": e.version, "path": e.path, "ctx": e.ctx,
                            "parallel": settings.parallel,
                            "chat_template": bool(e.tokenizer and e.tokenizer.has_chat_template),
                            "moe_layers": list(e.model.moe_layers),
                            "experts": e.model.config.num_experts,
                            "experts_per_token": e.model.config.num_experts_per_tok}}

    @app.get("/v1/models", responses=_errors(401))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}", responses=_errors(401, 404))
    async def model(model_id: str):
        routes.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health():
        e = holder.current
        s = e.scheduler.stats()
        return {"status": "ok", "model": routes.name, "version": e.version,
                "slots_busy": s["slots_busy"], "slots_total": s["slots_total"],
                "queue_depth": s["queue_depth"]}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {}}}, **_errors(401)})
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.post("/admin/reload", responses=_errors(401, 403, 409))
    async def admin_reload():
        if settings.api_key is None:
            raise APIError(403, "POST /admin/reload is available only when the server has an "
                                "api key (--api-key); send the process SIGHUP instead.",
                           code="admin_disabled")
        result = await reload("POST /admin/reload")
        if not result.reloaded and not result.unchanged:
            raise APIError(409, result.message, code="reload_refused")
        return result.as_dict()

    if settings.webui:
        register_webui(app)                      # the page at / (its files open, its API calls not)
    install_openapi(app, holder)                 # the document states the model's bounds too
    app.add_middleware(BodyLimit, max_body=settings.max_body)
    app.add_middleware(KeyGuard, key=settings.api_key,
                       open_paths=(OPEN_PATHS | WEBUI_PATHS) if settings.webui else OPEN_PATHS)
    app.add_middleware(CountRequests, metrics=metrics)
    return app
