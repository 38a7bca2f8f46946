"""The Edge's web console in a real browser (Debian's chromium, driven by
selenium through Debian's chromedriver; nothing is downloaded).

Usage: console_browser.py BASE_URL ADMIN_KEY USER_KEY SCREENSHOT_DIR

BASE_URL is the Edge's HTTP address (http://127.0.0.1:PORT); ADMIN_KEY an
admin key, USER_KEY a key without admin. The script talks with the test that
started it over its standard streams: it prints `KILL-NODE` when it wants
the node stopped and reads one line when it is. Screenshots go to
SCREENSHOT_DIR. Exits non-zero (with a message) on the first failed
expectation.
"""

import json
import sys
import threading
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

WAIT_S = 8


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def chat(base, key, model, stream=False):
    body = json.dumps(
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=body,
        headers={"authorization": "Bearer " + key, "content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def text(driver, css):
    # Read in one script call: the page replaces its tables every second, so
    # an element found first may be gone by the time it is read.
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", css)


def wait_for(driver, what, predicate):
    try:
        return WebDriverWait(
            driver, WAIT_S, poll_frequency=0.1,
            ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
        ).until(lambda d: predicate(d))
    except TimeoutException:
        seen = driver.execute_script(
            "const t = (id) => (document.getElementById(id) || {}).innerText;"
            "return {live: t('live'), summary: t('summary'), nodes: t('nodes'),"
            " requests: t('requests'), error: t('login-error')};")
        logs = ""
        try:
            logs = "\n".join(str(e) for e in driver.get_log("browser"))
        except Exception:
            pass
        raise SystemExit(f"FAILED: {what} within {WAIT_S} s; the page showed {seen}\n{logs}")


def visible(css):
    return ec.visibility_of_element_located((By.CSS_SELECTOR, css))


def sign_in(driver, key):
    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def served(driver):
    value = text(driver, "#tile-served .value").replace(",", "")
    return int(value) if value.isdigit() else -1


def main() -> None:
    base, admin_key, user_key, shots = sys.argv[1:5]
    driver = browser()
    try:
        driver.get(base + "/console")
        wait_for(driver, "the sign-in form", visible("#login"))

        # Wrong keys are refused, each with its reason, and show nothing.
        sign_in(driver, "sk-not-a-key-of-this-edge")
        wait_for(driver, "an unknown key refused",
                 lambda d: "does not know" in text(d, "#login-error"))
        sign_in(driver, user_key)
        wait_for(driver, "a key without admin refused",
                 lambda d: "not an admin key" in text(d, "#login-error"))
        check(not driver.find_element(By.ID, "dashboard").is_displayed(),
              "nothing shown to a refused key")
        check(admin_key not in driver.page_source, "no key in the page")

        # The admin key signs in: the node and its provider are listed.
        sign_in(driver, admin_key)
        wait_for(driver, "the dashboard", visible("#dashboard"))
        wait_for(driver, "node-1 ready",
                 visible('tr[data-node="node-1"][data-state="ready"]'))
        wait_for(driver, "provider p1 listed", visible('tr[data-provider="p1"]'))
        check(driver.get_cookie("iop_console") is not None, "a session cookie")
        check(driver.execute_script("return document.cookie").find("iop_console") < 0,
              "the session cookie is HttpOnly: the page's script cannot read it")
        check(text(driver, "#live") == "live", f"following the Edge live: {text(driver, '#live')}")

        # A request is counted (pushed by the Edge, no reload).
        before = served(driver)
        check(before >= 0, "the requests served are shown")
        status, _ = chat(base, admin_key, "mock:tokens=3")
        check(status == 200, f"chat answered: {status}")
        wait_for(driver, f"the request counted (from {before})", lambda d: served(d) > before)

        # A slow stream is listed with its phase while it runs.
        slow = threading.Thread(
            target=lambda: _swallow(lambda: chat(base, admin_key, "mock:tokens=400,tps=40", True)),
            daemon=True,
        )
        slow.start()
        wait_for(driver, "the slow stream listed as running",
                 visible('#requests tr[data-phase="running"]'))
        row = text(driver, '#requests tr[data-phase="running"]')
        check("chat" in row and "mock:tokens=400" in row, f"its route and model: {row!r}")
        driver.save_screenshot(f"{shots}/console-desktop.png")

        # On a phone-sized screen nothing runs off the side.
        driver.set_window_size(390, 844)
        time.sleep(0.3)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth")
        wide = driver.execute_script(
            "return [...document.querySelectorAll('body *')]"
            ".filter((e) => e.getBoundingClientRect().right > window.innerWidth + 1)"
            ".slice(0, 5).map((e) => e.tagName + '#' + e.id + '.' + e.className + ': '"
            " + (e.innerText || '').slice(0, 40));")
        check(overflow <= 1, f"no horizontal scrolling on a phone: {overflow}px, past the edge: {wide}")
        driver.save_screenshot(f"{shots}/console-phone.png")
        driver.set_window_size(1280, 1000)

        # The node goes away: its state changes within seconds.
        print("KILL-NODE", flush=True)
        check(sys.stdin.readline().strip() == "killed", "the test stopped the node")
        wait_for(driver, "node-1 shown disconnected",
                 visible('tr[data-node="node-1"][data-state="disconnected"]'))
        wait_for(driver, "the stream no longer listed",
                 lambda d: not d.find_elements(By.CSS_SELECTOR, '#requests tr[data-phase="running"]'))

        # Signing out ends the session.
        driver.find_element(By.ID, "sign-out").click()
        wait_for(driver, "the sign-in form again", visible("#login"))
        driver.get(base + "/console")
        wait_for(driver, "still signed out after a reload", visible("#login"))
        print("console browser checks passed", flush=True)
    finally:
        driver.quit()


def _swallow(call):
    try:
        call()
    except (urllib.error.URLError, OSError):
        pass  # the stream is cut when the node goes away


if __name__ == "__main__":
    main()
