"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

In vLLM's shapes, so that clients written for vLLM (lm-evaluation-harness's
`tokenizer_backend=remote`, which needs nothing but the server's URL) work unchanged:

    POST /tokenize {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
      or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
      -> {"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}
    POST /detokenize {"tokens": [int]} -> {"prompt": str}
    GET /tokenizer_info -> {"tokenizer_class": str, "eos_token", "bos_token", "pad_token",
                            ..., "chat_template"?}: the tokenizer's configuration
                            (tokenizer_config.json's fields, special tokens as strings)

`model` may be given (404 for another name). Behind the same api key as /v1 (auth.py guards
every route but /health). A model file without a tokenizer answers 400 `no_tokenizer`, a
chat without a template 400 `no_chat_template`, ids outside the vocabulary 400
`invalid_token_id`.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from pydantic import Field

from .errors import APIError
from .schemas import MAX_TEXT_CHARS, ChatMessage, ErrorBody, TokenId, _Strict

__all__ = ["register_tokenize_routes", "TokenizeCompletionRequest", "TokenizeChatRequest",
           "DetokenizeRequest"]

MAX_DETOKENIZE = 1 << 20          # ids one /detokenize may hold (the body limit binds first)


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize of a text."""
    model: str | None = None
    prompt: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize of a conversation, rendered with the model's chat template."""
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


def _plain(value):
    """tokenizer init kwargs as JSON: AddedToken-like objects as their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def tokenizer_info(tokenizer) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's init kwargs (file names dropped), its class,
    its special tokens and chat template."""
    hf = tokenizer.hf
    info = {k: _plain(v) for k, v in dict(getattr(hf, "init_kwargs", {}) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path",
                         "tokenizer_object")}
    for key, value in hf.special_tokens_map.items():
        info.setdefault(key, _plain(value))
    info["tokenizer_class"] = type(hf).__name__
    if tokenizer.has_chat_template:
        info["chat_template"] = hf.chat_template
    return info


def register_tokenize_routes(app: FastAPI, routes) -> None:
    """Add the three routes to `app`; routes: the app's _Route (model check, holder)."""
    errors = {c: {"model": ErrorBody} for c in (400, 401, 404, 413, 422)}

    def engine_tokenizer(requested: str | None):
        routes.check_model(requested)
        engine = routes.holder.current
        if engine.tokenizer is None:
            raise APIError(400, "This model file carries no tokenizer.", code="no_tokenizer")
        return engine, engine.tokenizer

    @app.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        engine, tok = engine_tokenizer(body.model)
        try:
            if isinstance(body, TokenizeChatRequest):
                if not tok.has_chat_template:
                    raise APIError(400, f"The model {routes.name!r} has no chat template in "
                                        f"its file.", code="no_chat_template", param="messages")
                text = tok.render_chat([{"role": m.role, "content": m.text()}
                                        for m in body.messages], body.add_generation_prompt)
            else:
                text = body.prompt
            ids = tok.encode(text, add_special_tokens=body.add_special_tokens, verbose=False)
        except APIError:
            raise
        except Exception as e:                     # noqa: BLE001 - the tokenizer's own refusal
            raise APIError(400, f"The text cannot be tokenized: {e}", code="invalid_prompt",
                           param="prompt") from None
        return {"count": len(ids), "max_model_len": engine.ctx, "tokens": ids,
                "token_strs": ([tok.hf.convert_ids_to_tokens(i) for i in ids]
                               if body.return_token_strs else None)}

    @app.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest):
        engine, tok = engine_tokenizer(body.model)
        V = engine.model.vocab_size
        bad = [t for t in body.tokens if t >= V]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of the vocabulary [0, {V}).",
                           code="invalid_token_id", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/tokenizer_info", responses=errors)
    async def get_tokenizer_info():
        _, tok = engine_tokenizer(None)
        return tokenizer_info(tok)
