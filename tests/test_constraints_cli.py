"""colibri generate --json-schema FILE / --grammar FILE / --regex: the printed text parses."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def run(*args):
    return subprocess.run([sys.executable, "-m", "colibri", "generate", "-p", "Once upon a time",
                           "-n", "60", "--seed", "0", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_schema_grammar_and_regex(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    out = run("--json-schema", str(schema))
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool)
    lark = tmp_path / "g.lark"
    lark.write_text('start: "colour=" ("red" | "blue")')
    out = run("--grammar", str(lark))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("colour=red", "colour=blue")
    out = run("--regex", "[0-9]{3}")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"[0-9]{3}", out.stdout.strip())


@pytest.mark.parametrize("args, words", [
    (["--regex", "a(b"], "unclosed group"),
    (["--json-schema", "missing.json"], "--json-schema missing.json: cannot read it"),
])
def test_cli_bad_constraint_is_a_clear_error(args, words):
    out = run(*args)
    assert out.returncode != 0
    assert words in out.stderr
    assert "Traceback" not in out.stderr
