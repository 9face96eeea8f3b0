"""A screenshot of the page at / of `colibri serve` in the middle of a conversation
(docs/img/webui.png, docs/serving.md "The page at /").

    python scripts/webui_screenshot.py --out docs/img/webui.png [--model MODEL.colibri]

Starts `colibri serve` on a free loopback port (the shipped model by default), opens the page
in headless chromium (Debian's chromium and chromedriver, through selenium), sends the
messages one after the other (temperature 0.8, seed 3 by default), waits for each reply to end, and saves the
window as PNG. The server is stopped afterwards, whatever happens.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

DEFAULT_MESSAGES = ["class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n",
                    "\n    def push(self, item):\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def up(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/health", timeout=1).status == 200
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--model", default=None, help="the .colibri file (default: the shipped one)")
    ap.add_argument("--message", action="append", default=None,
                    help="a message to send (repeat for several turns)")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--size", default="1280,900", help="window width,height in pixels")
    args = ap.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "colibri", "serve", *([args.model] if args.model else []),
             "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(serve)
    driver = None
    try:
        wait(lambda: server.poll() is not None or up(url), 60, "the server to start")
        if server.poll() is not None:
            raise SystemExit(f"colibri serve exited {server.returncode}")
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={args.size}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        driver.get(url + "/")
        wait(lambda: driver.find_element(By.ID, "mode").get_attribute("data-mode"), 20,
             "the page to connect")
        driver.execute_script("const f = (id, v) => document.getElementById(id).value = v;"
                              "f('temperature', arguments[0]); f('max-tokens', arguments[1]);"
                              "f('seed', arguments[2]);",
                              str(args.temperature), str(args.max_tokens), str(args.seed))
        for n, text in enumerate(args.message or DEFAULT_MESSAGES, 1):
            driver.execute_script("const i = document.getElementById('input'); "
                                  "i.value = arguments[0];"
                                  "document.getElementById('composer').requestSubmit();", text)
            wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#log .msg[data-done]")) >= n,
                 60, f"reply {n}")
        time.sleep(0.3)                       # the last frame of the heat map drawn
        driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
