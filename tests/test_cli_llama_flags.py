"""The flags llama.cpp users type (commands/common.py): -m/--model beside the positional
MODEL on every command that opens a model, -c/--ctx, -t/--threads, -s/--seed, and generate's
-n -1 ("until the context is full")."""
from __future__ import annotations

import pytest

from colibri.api import default_model_path
from colibri.cli import build_parser
from colibri.errors import ColibriError

from cli_helpers import one_line_error, run

MODEL_COMMANDS = {"generate": "model", "chat": "model", "bench": "model", "perplexity": "model",
                  "routes": "model", "serve": "model", "inspect": "file"}
REQUIRED = {"perplexity": ["-f", "text.txt"], "routes": ["-p", "hi"]}   # beside the model


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_dash_m_is_the_positional_model(command):
    parser = build_parser()
    dest = MODEL_COMMANDS[command]
    extra = REQUIRED.get(command, [])
    for argv in ([command, "-m", "a.colibri"], [command, "--model", "a.colibri"],
                 [command, "a.colibri"], [command, "a.colibri", "-m", "a.colibri"]):
        args, _ = parser.parse_known_args(argv + extra)
        assert getattr(args, dest) == "a.colibri", argv
    args, _ = parser.parse_known_args([command] + extra)
    assert getattr(args, dest) is None


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_two_different_models_is_one_line_error(command, capsys):
    code, _, err = run(capsys, command, "a.colibri", "-m", "b.colibri",
                       *REQUIRED.get(command, []))
    assert code == 2
    line = one_line_error(err, command)
    assert "'a.colibri'" in line and "'b.colibri'" in line and "not both" in line


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "perplexity", "routes", "serve"])
def test_threads_and_ctx_short_flags(command):
    parser = build_parser()
    extra = REQUIRED.get(command, [])
    args, _ = parser.parse_known_args([command, "-t", "2"] + extra)
    assert args.threads in (2, [2])
    if command != "bench":      # llama-bench has no -c either
        for flag in ("-c", "--ctx", "--ctx-size"):
            args, _ = parser.parse_known_args([command, flag, "64"] + extra)
            assert args.ctx == 64, flag


def test_generate_takes_llama_cli_flags(capsys):
    argv = ["generate", "-m", str(default_model_path()), "-p", "def f", "-n", "6",
            "--temp", "0.7", "--top-k", "5", "--top-p", "0.9", "-t", "1", "-c", "64"]
    outs = [run(capsys, *argv, "-s", "3")[1], run(capsys, *argv, "--seed", "3")[1]]
    assert outs[0] == outs[1] and outs[0].strip()
    positional = run(capsys, "generate", default_model_path(), *argv[3:], "-s", "3")[1]
    assert positional == outs[0]


def test_generate_n_minus_one_runs_to_the_context(capsys):
    code, out, err = run(capsys, "generate", "-p", "def f", "-n", "-1", "-c", "24",
                         "--temp", "0", "--verbose")
    assert code == 0, err
    assert "generation: 21 tokens" in err and "finish: ctx" in err    # 3 prompt + 21 = 24
    code, _, err = run(capsys, "generate", "-p", "def f", "-n", "-2")
    assert code == 2 and "-n -2" in one_line_error(err, "generate")


def test_chat_takes_llama_cli_sampling_flags():
    args = build_parser().parse_args(["chat", "-m", "a.colibri", "-n", "7", "--temp", "0.3",
                                      "--top-k", "5", "--top-p", "0.9", "-s", "4",
                                      "-sys", "Be brief."])
    assert (args.model, args.max_new_tokens, args.temp, args.top_k, args.top_p, args.seed,
            args.system) == ("a.colibri", 7, 0.3, 5, 0.9, 4, "Be brief.")


def test_serve_sampling_flags_are_request_defaults():
    """serve -n / --temp / --top-k / --top-p / --min-p / --repeat-penalty / -s fill the
    fields a request leaves out (llama-server's meaning); a field the request gives wins."""
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    pytest.importorskip("openai", reason="the openai client is not installed")
    from colibri.commands.serve import settings_from_args
    from server_helpers import client, running_server
    args, _ = build_parser().parse_known_args(
        ["serve", "-np", "2", "-n", "5", "--temp", "0", "--top-k", "3", "--top-p", "0.5",
         "--min-p", "0.1", "--repeat-penalty", "1.1", "-s", "9", "-c", "64", "-t", "1"])
    settings = settings_from_args(args)
    assert args.parallel == 2 and settings.defaults == {
        "max_tokens": 5, "temperature": 0.0, "top_k": 3, "top_p": 0.5, "min_p": 0.1,
        "repetition_penalty": 1.1, "seed": 9}
    settings.defaults = {"max_tokens": 5, "temperature": 0.0}
    with running_server(settings) as (url, _):
        c = client(url)
        plain = c.completions.create(model="", prompt="def f")
        assert plain.usage.completion_tokens == 5 or plain.choices[0].finish_reason == "stop"
        greedy = c.completions.create(model="", prompt="def f", temperature=0, max_tokens=5)
        assert plain.choices[0].text == greedy.choices[0].text      # --temp 0 applied
        short = c.completions.create(model="", prompt="def f", max_tokens=2)
        assert short.usage.completion_tokens <= 2                   # the request wins
    settings.defaults = {"max_tokens": -1, "temperature": 1.0, "seed": 11}
    with running_server(settings) as (url, _):
        c = client(url)
        runs = [c.completions.create(model="", prompt="def f") for _ in range(2)]
        assert runs[0].choices[0].text == runs[1].choices[0].text   # -s 11 applied
        u = runs[0].usage
        assert u.prompt_tokens + u.completion_tokens == 64 or \
            runs[0].choices[0].finish_reason == "stop"               # -n -1: to the context
    for bad, flag in ((["--top-p", "0"], "--top-p 0.0"), (["-n", "0"], "-n 0"),
                      (["--temp", "nan"], "--temp nan")):
        parsed, _ = build_parser().parse_known_args(["serve", *bad])
        with pytest.raises(ColibriError, match=flag):
            settings_from_args(parsed).check()
