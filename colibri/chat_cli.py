"""`colibri chat`: an interactive conversation with a model in the terminal.

The conversation (system prompt, then user and assistant turns) is rendered with the model's
chat template for every reply and the reply streams as it is sampled. Commands:

    /reset      forget the conversation (the system prompt stays)
    /routing    toggle showing, after each reply, the experts each of its tokens chose
    /help       the commands
    /exit       leave (as Ctrl-D)

Ctrl-C while a reply streams stops it (the part written stays in the conversation); at the
prompt it clears the line. On a terminal the input line is prompt_toolkit's (editing, the up
arrow recalls what was typed), or readline's where prompt_toolkit is not installed; otherwise
lines are read from stdin, so a session can be piped in. When the conversation outgrows the
context, its oldest exchanges are dropped.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, TextIO

from .errors import ColibriError

__all__ = ["ChatSession", "run_chat", "HELP"]

HELP = ("/reset forgets the conversation, /routing toggles showing each token's experts, "
        "/exit or Ctrl-D leaves; Ctrl-C stops a reply")
PROMPT = ">>> "


@dataclass
class ChatSession:
    """A conversation with `model` and the sampling settings of its replies."""
    model: object
    system: str | None = None
    max_new_tokens: int = 256
    ctx: int | None = None                           # tokens the conversation may hold
    sampling: dict = field(default_factory=dict)     # temperature, top_k, top_p, min_p, seed
    ignore_eos: bool = False
    show_routing: bool = False
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        tok = self.model.tokenizer
        if tok is None or not tok.has_chat_template:
            raise ColibriError(f"{self.model.file.path} has no chat template, so it cannot chat; "
                               f"use `colibri generate` to continue a prompt")
        self.ctx = min(self.ctx or self.model.max_context, self.model.max_context)
        self.turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _fit(self) -> list[int]:
        """The prompt ids of the conversation, its oldest exchanges dropped until the prompt
        and a reply of max_new_tokens fit in the model's context."""
        ctx = self.ctx
        while True:
            ids = self.model.tokenizer.apply_chat_template(self.messages)
            if len(ids) + min(self.max_new_tokens, 16) < ctx:
                return ids
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                self.messages.pop()
                raise ColibriError(f"the message is too long: {len(ids)} tokens, and the "
                                   f"context holds {ctx}")
            del self.messages[first:first + 2]

    def reply(self, text: str, write: Callable[[str], None]) -> list:
        """Add the user's `text`, stream the reply through `write` and add it; returns the
        reply's Steps (token, text, routing) when show_routing, else []. KeyboardInterrupt
        ends the reply early (what was written is kept) and is not raised."""
        self.messages.append({"role": "user", "content": text})
        ids = self._fit()
        sampling = dict(self.sampling)
        if sampling.get("seed") is not None:      # reproducible, yet not the same draws each turn
            sampling["seed"] += self.turns
        self.turns += 1
        pieces, steps, stream = [], [], None
        try:                                      # Ctrl-C may come before the first token too
            stream = self.model.generate(ids, max_new_tokens=min(self.max_new_tokens,
                                                                 self.ctx - len(ids)),
                                         stream=True, return_routing=True, ctx=self.ctx,
                                         stop=[] if self.ignore_eos else None, **sampling)
            for step in stream:
                pieces.append(step.text)
                steps.append(step)
                write(step.text)
        except KeyboardInterrupt:
            write(" [stopped]")
        finally:
            if stream is not None:
                stream.close()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        return steps if self.show_routing else []


def routing_lines(model, steps: list) -> list[str]:
    """One line per token: "'text' L0 [3 0.62, 5 0.38] L1 [...]" (as generate --verbose)."""
    from .tools.trace import Trace, format_route
    out = []
    for step in steps:
        if step.routing is None:
            continue
        tr = Trace.from_routing(step.routing, [step.token], tokenizer=model.tokenizer)
        cells = " ".join(f"L{layer} [{format_route(tr.experts[0, j], tr.weights[0, j])}]"
                         for j, layer in enumerate(tr.layers))
        out.append(f"  {tr.tokens[0]!r:>14} {cells}")
    return out


def _line_reader(interactive: bool) -> Callable[[], str]:
    """A function returning the next input line (EOFError at the end, KeyboardInterrupt on
    Ctrl-C): prompt_toolkit's prompt on a terminal, readline's input() where prompt_toolkit
    is missing or the terminal is dumb (its fallback there ignores Ctrl-D), plain stdin when
    not interactive."""
    if not interactive:
        def read() -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")
        return read
    if os.environ.get("TERM", "dumb") != "dumb":
        try:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory
        except ImportError:
            pass
        else:
            session = PromptSession(history=InMemoryHistory())
            return lambda: session.prompt(PROMPT)
    try:
        import readline  # noqa: F401 - input() gains line editing and the up arrow's history
    except ImportError:                    # not on every platform: plain input() then
        pass
    return lambda: input(PROMPT)


def run_chat(session: ChatSession, out: TextIO = sys.stdout,
             interactive: bool | None = None) -> int:
    """The loop: read a line, run a command or reply to it, until Ctrl-D or /exit."""
    if interactive is None:
        interactive = sys.stdin.isatty() and out.isatty()
    read = _line_reader(interactive)

    def write(text: str) -> None:
        out.write(text)
        out.flush()
    write(f"colibri chat with {os.path.basename(str(session.model.file.path))}: {HELP}\n")
    while True:
        try:
            line = read()
        except KeyboardInterrupt:          # at the prompt: drop the line, a fresh prompt below
            write("\n")
            continue
        except EOFError:
            write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            write("(the conversation is cleared)\n")
            continue
        if text == "/routing":
            session.show_routing = not session.show_routing
            write("(routing on: each reply is followed by its tokens' experts)\n"
                  if session.show_routing else "(routing off)\n")
            continue
        if text in ("/help", "/?"):
            write(HELP + "\n")
            continue
        if text.startswith("/"):
            write(f"(unknown command {text.split()[0]}; {HELP})\n")
            continue
        try:
            steps = session.reply(line, write)
        except ColibriError as e:
            write(f"(error: {e})\n")
            continue
        write("\n")
        if steps:
            write("\n".join(routing_lines(session.model, steps)) + "\n")
