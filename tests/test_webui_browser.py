"""The page at / of colibri serve in a real headless browser (Debian's chromium and its
chromedriver, through selenium), against a real server on loopback: a chat streamed token by
token with the heat map filling while it runs, the answer and the routing counts equal to
what the API gives the official client for the same request, a second turn with the history,
stop, reset, the text-continuation fallback of a model without a chat template, and the api
key asked for and sent. Skipped, with the reason, where chromium or its driver is absent."""
from __future__ import annotations

import shutil
import time
from collections import Counter

import pytest

import colibri
from colibri.server import Settings

from hf_factory import copy_checkpoint
from server_helpers import KEY, client, running_server, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By                      # noqa: E402
from selenium.webdriver.common.keys import Keys                  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") \
    or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="needs chromium and chromedriver (Debian: apt install "
                                       "chromium chromium-driver)")
STEP_SECONDS = 0.08        # each forward pass slowed to this, to watch a reply while it runs


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def chat_model(hf_checkpoint, tmp_path_factory):
    """A tiny mixtral .colibri file with a tokenizer and a chat template."""
    dst = tmp_path_factory.mktemp("webui") / "chat.colibri"
    return colibri.convert(hf_checkpoint("mixtral"), dst, progress=False)


@pytest.fixture(scope="module")
def plain_model(hf_checkpoint, tmp_path_factory):
    """The same model with a tokenizer but no chat template."""
    where = tmp_path_factory.mktemp("webui-plain")
    src = copy_checkpoint(hf_checkpoint("mixtral"), where / "hf")
    (src / "chat_template.jinja").unlink()
    return colibri.convert(src, where / "plain.colibri", progress=False)


@pytest.fixture(scope="module")
def chat_server(chat_model):
    with running_server(Settings(model=str(chat_model), parallel=2, ctx=256,
                                 threads=1)) as served:
        yield served


def slow_down(app, monkeypatch) -> None:
    """Every forward pass of the served model takes STEP_SECONDS more (the tiny model makes
    hundreds of tokens a second, faster than a page can be watched)."""
    model = app.state.holder.current.model
    for name in ("forward_ragged", "forward"):         # a step of one request runs forward
        fast = getattr(model, name)

        def slowed(*args, fast=fast, **kwargs):
            time.sleep(STEP_SECONDS)
            return fast(*args, **kwargs)
        monkeypatch.setattr(model, name, slowed)


# -- reading and driving the page -----------------------------------------------------------------
def open_page(driver, url: str, mode: str | None = "chat") -> None:
    driver.get(url + "/")
    if mode is not None:
        wait_for(lambda: driver.find_element(By.ID, "mode").get_attribute("data-mode") == mode,
                 timeout=15, what=f"the page to connect in {mode} mode")


def set_field(driver, element_id: str, value) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")


def wait_reply(driver, n: int, timeout: float = 20.0) -> str:
    """The state of the n-th reply (1-based) once it has ended: done / stopped / error."""
    def ended():
        r = replies(driver)
        return len(r) >= n and r[n - 1].get_attribute("data-done")
    return wait_for(ended, timeout=timeout, what=f"reply {n} to end")


def reply_text(driver, n: int) -> str:
    """The text of reply n as its token spans hold it."""
    return driver.execute_script(
        "const r = document.querySelectorAll('#log .msg.assistant')[arguments[0]];"
        "return Array.from(r.querySelectorAll('.tok')).map(s => s.textContent).join('');", n - 1)


def heat_counts(driver) -> Counter:
    """(layer, expert) -> tokens, as the heat map's cells state it."""
    cells = driver.execute_script(
        "return Array.from(document.querySelectorAll('#heatmap rect.cell')).map(r => "
        "[+r.dataset.layer, +r.dataset.expert, +r.dataset.count]);")
    return Counter({(m, e): c for m, e, c in cells if c})


def heat_tokens(driver) -> int:
    return int(driver.find_element(By.ID, "heatmap").get_attribute("data-tokens") or 0)


def snapshot(driver) -> dict:
    """What the page shows now, read in one script (nothing moves between the readings)."""
    return driver.execute_script(
        "const cells = Array.from(document.querySelectorAll('#heatmap rect.cell'));"
        "const r = document.querySelectorAll('#log .msg.assistant');"
        "return {busy: document.body.dataset.busy === '1',"
        " tokens: +(document.getElementById('heatmap').dataset.tokens || 0),"
        " cells: cells.reduce((a, c) => a + +c.dataset.count, 0),"
        " text: r.length ? r[r.length - 1].querySelector('.body').textContent : '',"
        " stop_disabled: document.getElementById('stop').disabled};")


def routing_counts(ext: dict, moe_layers: list[int]) -> Counter:
    out = Counter()
    for token in ext["routing"]:
        for m, experts in enumerate(token):
            for e in experts:
                out[(moe_layers[m], e)] += 1
    return out


# -- the tests -------------------------------------------------------------------------------------
def test_chat_streams_and_the_heat_map_fills_as_tokens_arrive(browser, chat_server,
                                                              monkeypatch):
    url, app = chat_server
    api = client(url)
    moe_layers = list(app.state.holder.current.model.moe_layers)
    first = [{"role": "user", "content": "hello there"}]
    want = api.chat.completions.create(model="chat", messages=first, temperature=0,
                                       max_tokens=12, extra_body={"colibri": {"routing": True}})
    want_ext = want.choices[0].model_extra["colibri"]
    assert len(want_ext["routing"]) >= 3, "the reference reply is too short to watch"

    slow_down(app, monkeypatch)
    open_page(browser, url)
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 12)
    send(browser, "hello there")
    # mid-stream (one snapshot of the page, taken at once): the reply is running and the
    # cells hold the routing of the tokens so far (its text may lag: a token can be part of
    # a UTF-8 character, shown with the next)
    total = len(want_ext["routing"])
    mid = wait_for(lambda: (lambda m: m["busy"] and 1 <= m["tokens"] < total and m)(
        snapshot(browser)), timeout=20, what="the heat map to fill while the reply streams")
    assert mid["cells"] == mid["tokens"] * len(moe_layers) * 2      # top-2 in every layer
    assert not mid["stop_disabled"]
    assert wait_reply(browser, 1) == "done"
    # the whole reply: the same text and the same routing as the API gives the client
    assert reply_text(browser, 1) == want.choices[0].message.content
    assert heat_tokens(browser) == len(want_ext["routing"])
    assert heat_counts(browser) == routing_counts(want_ext, moe_layers)
    spans = browser.find_elements(By.CSS_SELECTOR, "#log .msg.assistant .tok[data-experts]")
    assert spans and all(len(s.get_attribute("data-experts").split(",")) == 2 for s in spans)
    bars = browser.execute_script("return Array.from(document.querySelectorAll("
                                  "'#utilisation rect.bar')).map(b => +b.dataset.share);")
    assert len(bars) == 4 and sum(bars) == pytest.approx(2.0, abs=1e-3)   # top-2 of 4

    # a second turn carries the history; the counts add up over the conversation
    second = first + [{"role": "assistant", "content": want.choices[0].message.content},
                      {"role": "user", "content": "and then?"}]
    want2 = api.chat.completions.create(model="chat", messages=second, temperature=0,
                                        max_tokens=12, extra_body={"colibri": {"routing": True}})
    send(browser, "and then?")
    assert wait_reply(browser, 2) == "done"
    assert reply_text(browser, 2) == want2.choices[0].message.content
    both = routing_counts(want_ext, moe_layers) + routing_counts(
        want2.choices[0].model_extra["colibri"], moe_layers)
    assert heat_counts(browser) == both


def test_stop_frees_the_slot_and_reset_forgets_even_mid_reply(browser, chat_server,
                                                              monkeypatch):
    url, app = chat_server
    slow_down(app, monkeypatch)
    scheduler = app.state.holder.current.scheduler
    # the random model may sample its end-of-sequence id within a few tokens, and a reply
    # that ends by itself races the click: here only the stop button ends it
    monkeypatch.setattr(scheduler, "_default_stop_ids", set())
    stats = scheduler.stats
    open_page(browser, url)
    set_field(browser, "max-tokens", 200)
    send(browser, "tell me everything")
    wait_for(lambda: heat_tokens(browser) >= 2, timeout=15, what="the reply to start")
    browser.find_element(By.ID, "stop").click()
    assert wait_reply(browser, 1) == "stopped"
    assert heat_tokens(browser) < 100
    wait_for(lambda: stats()["slots_busy"] == 0, timeout=5, what="the server to free the slot")
    assert not browser.find_element(By.ID, "send").get_property("disabled")

    browser.find_element(By.ID, "reset").click()
    assert replies(browser) == [] and heat_tokens(browser) == 0 and heat_counts(browser) == {}

    # reset while a reply streams: it ends, and nothing of it stays in the new conversation
    send(browser, "tell me everything")
    wait_for(lambda: heat_tokens(browser) >= 2, timeout=15, what="the reply to start")
    browser.find_element(By.ID, "reset").click()
    wait_for(lambda: stats()["slots_busy"] == 0, timeout=5, what="the server to free the slot")
    assert replies(browser) == [] and heat_tokens(browser) == 0
    first = [{"role": "user", "content": "hello there"}]
    want = client(url).chat.completions.create(model="chat", messages=first, temperature=0,
                                               max_tokens=6,
                                               extra_body={"colibri": {"routing": True}})
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 6)
    send(browser, "hello there")
    assert wait_reply(browser, 1) == "done"
    assert reply_text(browser, 1) == want.choices[0].message.content   # no history before it
    assert heat_tokens(browser) == len(want.choices[0].model_extra["colibri"]["routing"])


def test_model_without_a_chat_template_continues_text(browser, plain_model):
    with running_server(Settings(model=str(plain_model), parallel=1, ctx=128,
                                 threads=1)) as (url, _):
        want = client(url).completions.create(model="plain", prompt="once upon", max_tokens=6,
                                              temperature=0)
        open_page(browser, url, mode="completion")
        notice = browser.find_element(By.ID, "notice")
        assert notice.is_displayed() and "no chat template" in notice.text
        set_field(browser, "temperature", 0)
        set_field(browser, "max-tokens", 6)
        send(browser, "once upon")
        assert wait_reply(browser, 1) == "done"
        assert reply_text(browser, 1) == want.choices[0].text
        assert heat_tokens(browser) == want.usage.completion_tokens
        # too long for the context: the server's reason and what to do; the text is kept
        set_field(browser, "max-tokens", 500)
        send(browser, " there")
        assert wait_reply(browser, 2) == "error"
        error = browser.find_element(By.CSS_SELECTOR, "#log .msg.assistant.error .errmsg").text
        assert "128" in error and "Reset the conversation" in error
        # the next message continues the text so far: prompt, reply, message
        set_field(browser, "max-tokens", 6)
        send(browser, " was")
        assert wait_reply(browser, 3) == "done"
        text = "once upon" + want.choices[0].text + " was"
        want3 = client(url).completions.create(model="plain", prompt=text, max_tokens=6,
                                               temperature=0)
        assert reply_text(browser, 3) == want3.choices[0].text


def test_api_key_is_asked_for_and_sent(browser, chat_model):
    with running_server(Settings(model=str(chat_model), parallel=1, ctx=128, threads=1,
                                 api_key=KEY)) as (url, _):
        browser.get("about:blank")               # a fresh tab state: no key kept from before
        open_page(browser, url, mode=None)
        browser.execute_script("sessionStorage.clear();")
        browser.refresh()
        dialog = browser.find_element(By.ID, "key-dialog")
        wait_for(dialog.is_displayed, timeout=10, what="the page to ask for the key")
        assert browser.find_element(By.ID, "send").get_property("disabled")
        set_field(browser, "key-input", "not-the-key-at-all")
        browser.find_element(By.ID, "key-input").send_keys(Keys.ENTER)
        wait_for(lambda: "refused" in browser.find_element(By.ID, "key-message").text,
                 timeout=10, what="the wrong key to be refused")
        set_field(browser, "key-input", KEY)
        browser.find_element(By.ID, "key-input").send_keys(Keys.ENTER)
        wait_for(lambda: browser.find_element(By.ID, "mode").get_attribute("data-mode")
                 == "chat", timeout=10, what="the page to connect with the key")
        assert not dialog.is_displayed()
        set_field(browser, "max-tokens", 4)
        send(browser, "hi")
        assert wait_reply(browser, 1) == "done"
        assert heat_tokens(browser) > 0
        browser.execute_script("sessionStorage.clear();")
