"""`colibri chat` under a real pseudo-terminal (pexpect): readline's input line, the
streamed reply, /routing, /reset, Ctrl-C stopping a reply without leaving, Ctrl-D leaving;
the replies checked against colibri.generate on the same conversation."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import colibri
from hf_factory import copy_checkpoint

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "


@pytest.fixture(scope="module")
def chat_model(hf_checkpoint, tmp_path_factory):
    dst = tmp_path_factory.mktemp("chat-cli") / "chat.colibri"
    # a context long enough for a reply still streaming when Ctrl-C comes
    return colibri.convert(hf_checkpoint("mixtral", max_position_embeddings=16384), dst,
                           progress=False)


def _interruptible() -> None:
    """The child's SIGINT as a person's terminal gives it: a test run started in the
    background (a non-interactive shell's `&`) inherits SIGINT ignored, and a Python started
    so never raises KeyboardInterrupt: Ctrl-C would not reach the chat."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str):
    env = dict(os.environ, TERM="dumb", COLUMNS="200", LINES="50")    # readline's line
    child = pexpect.spawn(sys.executable, ["-m", "colibri", "chat", *args], env=env,
                          encoding="utf-8", codec_errors="replace", timeout=60,
                          dimensions=(50, 200),   # the tty's ^C echo may split a character
                          preexec_fn=_interruptible)
    child.expect_exact(PROMPT)
    return child


def expected_reply(model_path, messages, n):
    m = colibri.load(model_path, threads=1)
    return m.generate(messages, chat=True, max_new_tokens=n, temperature=0)


def test_a_conversation_with_routing_and_reset(chat_model):
    child = spawn("-m", str(chat_model), "-n", "8", "--temp", "0", "-t", "1")
    child.sendline("Hello there")
    child.expect_exact(PROMPT)
    first = expected_reply(chat_model, [{"role": "user", "content": "Hello there"}], 8)
    assert first.strip() and first.strip()[:6] in child.before
    # the second turn sees the first one (history)
    child.sendline("/routing")
    child.expect_exact("routing on")
    child.expect_exact(PROMPT)
    child.sendline("And again")
    child.expect_exact(PROMPT)
    out = child.before
    assert out.count(" L0 [") >= 1 and " L1 [" in out      # one line per token, each layer
    second = expected_reply(chat_model, [{"role": "user", "content": "Hello there"},
                                         {"role": "assistant", "content": first},
                                         {"role": "user", "content": "And again"}], 8)
    assert second.strip()[:6] in out
    child.sendline("/reset")
    child.expect_exact("cleared")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_ctrl_d_leaves(chat_model):
    child = spawn(str(chat_model), "-n", "100000", "--ignore-eos", "-t", "1", "--seed", "0")
    child.sendline("Tell me a long story")
    child.expect_exact("story\r\n")                        # the line is read: the reply starts
    time.sleep(1)
    child.sendintr()
    child.expect_exact("[stopped]", timeout=20)
    child.expect_exact(PROMPT)
    child.send("half a line")                              # Ctrl-C at the prompt drops it
    child.expect_exact("half a line")      # typed, as a person sees it, before the Ctrl-C (a
    child.sendintr()                       # ^C flushes the tty's queues: unread keys are lost)
    child.expect_exact(PROMPT)
    child.sendline("/help")
    child.expect_exact("/reset")                           # still running
    child.expect_exact(PROMPT)
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_model_without_template_is_one_clear_error(hf_checkpoint, tmp_path):
    src = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "hf")
    (src / "chat_template.jinja").unlink()
    plain = colibri.convert(src, tmp_path / "plain.colibri", progress=False)
    assert not colibri.load(plain).tokenizer.has_chat_template
    child = pexpect.spawn(sys.executable, ["-m", "colibri", "chat", "-m", str(plain)],
                          encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    lines = [ln for ln in child.before.splitlines() if ln.strip()]
    assert child.exitstatus == 2 and len(lines) == 1 and "no chat template" in lines[0]


def test_prompt_toolkit_line_history_reply_and_ctrl_d(chat_model):
    """On a real terminal type (xterm) the input line is prompt_toolkit's: the up arrow
    recalls the last line, the reply streams between prompts, Ctrl-D leaves."""
    pytest.importorskip("prompt_toolkit")
    env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")  # pexpect answers no CPR
    child = pexpect.spawn(sys.executable, ["-m", "colibri", "chat", str(chat_model), "-n", "8",
                                           "--temp", "0", "-t", "1"], env=env,
                          encoding="utf-8", codec_errors="replace", timeout=60,
                          dimensions=(50, 200))   # the tty's ^C echo may split a character
    child.expect_exact(">>>")
    child.sendline("/help")
    child.expect_exact("/routing toggles")
    child.send("\x1b[A")                                    # up: "/help" again
    child.expect_exact("/help")
    child.send("\r")
    child.expect_exact("/routing toggles")
    child.sendline("Hello there")
    want = expected_reply(chat_model, [{"role": "user", "content": "Hello there"}], 8)
    child.expect_exact(want.strip()[:6])                    # the streamed reply
    child.expect_exact(">>>")                               # the next prompt
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_piped_question_on_the_shipped_model():
    """README's `colibri chat` with stdin not a terminal (as .ci/run pipes a question): the
    shipped model's reply through its chat template, then exit 0 at the end of input."""
    import subprocess
    q = "What does os.path.join do?"
    r = subprocess.run([sys.executable, "-m", "colibri", "chat", "-n", "16", "--temp", "0",
                        "-t", "1"], input=q + "\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = colibri.load(threads=1)
    want = m.generate([{"role": "user", "content": q}], chat=True, max_new_tokens=16,
                      temperature=0)
    assert want.strip() and want in r.stdout
