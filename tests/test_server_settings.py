"""colibri.server.settings (sizes, the loopback rule, ranges) and `colibri serve`'s flags."""
from __future__ import annotations

import pytest

from colibri.cli import build_parser
from colibri.commands.serve import settings_from_args
from colibri.errors import ColibriError
from colibri.server.settings import Settings, is_loopback, parse_bytes

from cli_helpers import one_line_error, run


@pytest.mark.parametrize("text, value", [("1000000", 10**6), ("6GiB", 6 * 2**30),
                                         ("512MB", 512 * 10**6), ("1.5g", 15 * 10**8),
                                         ("64 KiB", 65536), (4096, 4096)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "6 GB/s", "-1", "0", "1e400", "nan", "six", "5XB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.3.2.1") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    assert not is_loopback("no-such-host.invalid")


def test_non_loopback_needs_a_key_or_insecure():
    with pytest.raises(ColibriError, match="not a loopback address, without --api-key"):
        Settings(host="0.0.0.0").check()
    Settings(host="0.0.0.0", api_key="k" * 16).check()
    Settings(host="0.0.0.0", insecure=True).check()
    Settings().check()


@pytest.mark.parametrize("field, value", [("parallel", 0), ("max_queue", -1), ("ctx", 1),
                                          ("port", 70000), ("max_body", 10), ("threads", 0),
                                          ("activations", "f64"), ("api_key", "short"),
                                          ("model", "no/such/file.colibri")])
def test_settings_out_of_range(field, value):
    with pytest.raises(ColibriError, match=field.replace("_", "[_ ]") if field not in
                       ("api_key", "model") else "."):
        Settings(**{field: value}).check()


def test_cli_flags_become_settings():
    args = build_parser().parse_args(
        ["serve", "m.colibri", "--host", "::1", "--port", "0", "--parallel", "8", "--ctx", "512",
         "--kv-budget", "6GiB", "--max-queue", "3", "--api-key", "k" * 10, "--pid-file", "p",
         "--max-body", "64KiB", "--threads", "2", "--activations", "f32",
         "--model-name", "tiny"])
    s = settings_from_args(args)
    assert (s.model, s.host, s.port, s.parallel, s.ctx, s.kv_budget, s.max_queue, s.api_key,
            s.pid_file, s.max_body, s.threads, s.activations, s.model_name) == \
        ("m.colibri", "::1", 0, 8, 512, 6 * 2**30, 3, "k" * 10, "p", 65536, 2, "f32", "tiny")
    assert settings_from_args(build_parser().parse_args(["serve"])).model is None  # shipped
    s = settings_from_args(build_parser().parse_args(
        ["serve", "--expert-shards", "2", "--shard-memory-budget", "3MiB"]))
    assert (s.expert_shards, s.shard_memory_budget) == (2, 3 * 2**20)


@pytest.mark.parametrize("fields", [{"shard_memory_budget": 2**20},      # without shards
                                    {"expert_shards": 2, "shard_memory_budget": -1},
                                    {"expert_shards": 2, "shard_memory_budget": "1MiB"}])
def test_shard_memory_budget_needs_shards_and_bytes(fields):
    with pytest.raises(ColibriError, match="shard_memory_budget .*expert_shards"):
        Settings(**fields).check()


def test_cli_refuses_an_open_host_without_a_key(capsys):
    code, out, err = run(capsys, "serve", "--host", "0.0.0.0")
    assert code == 2
    assert "without --api-key" in one_line_error(err, "serve")


def test_cli_bad_size(capsys):
    code, _, err = run(capsys, "serve", "--kv-budget", "lots")
    assert code == 2 and "--kv-budget" in err and "lots" in err
