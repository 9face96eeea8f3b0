"""The OpenAPI document of the model being served: the schemas' bounds plus the model's own.

fastapi makes the document from the pydantic schemas (schemas.py), whose bounds hold for
any model. What a request may hold also depends on the model file served, and the document
says that too, so that a client (or schemathesis) reading it sends only what the server
takes:
- token ids (prompts, /detokenize) below the vocabulary size;
- a prompt of token ids at most ctx ids long, max_tokens at most ctx - 1 (a prompt holds
  one token at least); that prompt + max_tokens fit ctx is checked per request (400
  context_length_exceeded), which no schema can say;
- no conversation on /tokenize for a model without a chat template (400 no_chat_template;
  /v1/chat/completions stays listed: the route exists and says why it refuses);
- no text prompts and no tokenizer routes for a model file without a tokenizer.
The document is remade when a reload brings another model version.
"""
from __future__ import annotations

import copy

from fastapi import FastAPI

__all__ = ["install_openapi", "served_openapi"]


def _id_items(schema: dict, top: int) -> None:
    schema["maximum"] = top


def _int_branch(schema: dict) -> dict:
    """The integer branch of an Optional[int] field's anyOf (or the schema itself)."""
    for s in schema.get("anyOf", [schema]):
        if s.get("type") == "integer":
            return s
    return schema


def served_openapi(base: dict, engine) -> dict:
    """A copy of fastapi's document `base` with the bounds of `engine`'s model."""
    doc = copy.deepcopy(base)
    schemas = doc.get("components", {}).get("schemas", {})
    V, ctx, tok = engine.model.vocab_size, engine.ctx, engine.tokenizer
    comp = schemas.get("CompletionRequest")
    if comp is not None:
        branches = comp["properties"]["prompt"]["anyOf"]
        for b in branches:
            if b.get("type") != "array":
                continue
            items = b["items"]
            if items.get("type") == "integer":                      # [ids]
                _id_items(items, V - 1)
                b["maxItems"] = ctx
            elif items.get("type") == "array":                      # [[ids], ...]
                _id_items(items["items"], V - 1)
                items["maxItems"] = ctx
        if tok is None:                                             # ids only
            comp["properties"]["prompt"]["anyOf"] = [
                b for b in branches if b.get("type") == "array"
                and b["items"].get("type") in ("integer", "array")]
        _int_branch(comp["properties"]["max_tokens"])["maximum"] = ctx - 1
    chat = schemas.get("ChatCompletionRequest")
    if chat is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            _int_branch(chat["properties"][name])["maximum"] = ctx - 1
    detok = schemas.get("DetokenizeRequest")
    if detok is not None:
        _id_items(detok["properties"]["tokens"]["items"], V - 1)
    paths = doc.get("paths", {})
    if tok is None:
        for p in ("/tokenize", "/detokenize", "/tokenizer_info"):
            paths.pop(p, None)
    elif not tok.has_chat_template:
        body = paths.get("/tokenize", {}).get("post", {}).get("requestBody", {})
        schema = body.get("content", {}).get("application/json", {}).get("schema", {})
        if "anyOf" in schema:
            schema["anyOf"] = [s for s in schema["anyOf"]
                               if not s.get("$ref", "").endswith("/TokenizeChatRequest")]
            if len(schema["anyOf"]) == 1:
                only = schema.pop("anyOf")[0]
                schema.update(only)
    return doc


def install_openapi(app: FastAPI, holder) -> None:
    """Make app.openapi() answer served_openapi() of the engine serving now."""
    make = app.openapi                         # fastapi's, cached in app.openapi_schema
    made: dict = {}

    def openapi() -> dict:
        engine = holder.current
        if made.get("version") != engine.version:
            base = make()
            made.update(version=engine.version, doc=served_openapi(base, engine))
        return made["doc"]
    app.openapi = openapi
