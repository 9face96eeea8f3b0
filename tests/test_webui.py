"""The page at / of colibri serve over plain HTTP: its files, their types and headers, nothing
external, shipped as package data, --no-webui, and how --api-key gates it. The page itself
is driven in a real browser in tests/test_webui_browser.py."""
from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

import colibri.server
from colibri.cli import build_parser
from colibri.commands.serve import settings_from_args
from colibri.server import Settings
from colibri.server.webui import CSP, WEBUI_FILES

from server_helpers import KEY, request, running_server

WEBUI_DIR = Path(colibri.server.__file__).parent / "webui"
ROOT = Path(__file__).resolve().parent.parent      # the checkout (colibri may be installed)


def shipped_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(WEBUI_DIR.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def plain():
    with running_server(Settings(parallel=1, ctx=64, threads=1)) as served:
        yield served[0]


@pytest.fixture(scope="module")
def keyed():
    with running_server(Settings(parallel=1, ctx=64, threads=1, api_key=KEY)) as served:
        yield served[0]


@pytest.fixture(scope="module")
def off():
    with running_server(Settings(parallel=1, ctx=64, threads=1, webui=False)) as served:
        yield served[0]


def test_every_file_is_served_with_its_type_and_the_policy(plain):
    for path, (name, media_type) in WEBUI_FILES.items():
        status, headers, body = request(plain, "GET", path)
        assert status == 200, path
        assert headers["content-type"] == media_type
        assert headers["content-security-policy"] == CSP
        assert headers["x-content-type-options"] == "nosniff"
        assert body == (WEBUI_DIR / name).read_text()


def test_every_shipped_file_is_served_and_listed_as_package_data():
    served = {name for name, _ in WEBUI_FILES.values()}
    assert set(shipped_files()) == served
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["colibri.server.webui"]
    for name in served:
        assert any(fnmatch.fnmatch(name, g) for g in globs), name


def test_nothing_is_fetched_from_elsewhere():
    """No URL but this server's own paths: no CDN, no external font, no analytics."""
    for name, text in shipped_files().items():
        # the SVG namespace is an identifier, never fetched
        urls = [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text)
                if u != "http://www.w3.org/2000/svg"]
        assert urls == [], (name, urls)
        assert "@import" not in text and "url(" not in text, name
    page = (WEBUI_DIR / "index.html").read_text()
    refs = re.findall(r"(?:src|href)=\"([^\"]*)\"", page)
    assert refs and all(r in WEBUI_FILES or r == "data:," for r in refs), refs
    assert "'self'" in CSP and "http" not in CSP


def test_the_scripts_name_only_elements_the_page_has():
    page = (WEBUI_DIR / "index.html").read_text()
    ids = set(re.findall(r"\bid=\"([\w-]+)\"", page))
    used = set(re.findall(r"\$\(\"([\w-]+)\"\)", (WEBUI_DIR / "app.js").read_text()))
    assert used and used <= ids, used - ids


def test_the_page_is_not_in_the_openapi_document(plain):
    _, _, doc = request(plain, "GET", "/openapi.json")
    assert "/" not in doc["paths"] and not any(p.startswith("/webui") for p in doc["paths"])


def test_api_key_opens_the_files_but_not_the_api(keyed):
    """The files hold no model data (like /health they are open); everything the page does
    goes through the API, which refuses it without the key."""
    for path in WEBUI_FILES:
        assert request(keyed, "GET", path)[0] == 200, path
    status, headers, _ = request(keyed, "GET", "/v1/models")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    body = {"prompt": "x", "max_tokens": 1, "stream": True, "colibri": {"routing": True}}
    assert request(keyed, "POST", "/v1/completions", body)[0] == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert request(keyed, "GET", "/v1/models", headers=auth)[0] == 200
    assert request(keyed, "GET", "/webui/other.js")[0] == 401     # only the page's own files


def test_no_webui_is_a_404(off):
    for path in WEBUI_FILES:
        status, _, body = request(off, "GET", path)
        assert status == 404, path
    assert request(off, "GET", "/health")[0] == 200


def test_no_webui_with_a_key_is_closed_like_any_other_path():
    with running_server(Settings(parallel=1, ctx=64, threads=1, api_key=KEY,
                                 webui=False)) as (url, _):
        assert request(url, "GET", "/")[0] == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert request(url, "GET", "/", headers=auth)[0] == 404


def test_no_webui_flag():
    parse = build_parser().parse_args
    assert settings_from_args(parse(["serve"])).webui is True
    assert settings_from_args(parse(["serve", "--no-webui"])).webui is False
