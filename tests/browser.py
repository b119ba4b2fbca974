"""Headless Chromium from Debian's packages, driven by selenium through Debian's chromedriver: nothing downloads
a browser or a driver. Flags from ../shared/ENVIRONMENT.md (the closed network refuses background fetches)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--no-first-run", "--window-size=1440,2000"]


@contextmanager
def chromium(scratch: Path) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for binary in (CHROMIUM, CHROMEDRIVER):
        if not Path(binary).exists():
            raise RuntimeError(f"{binary} is missing: infra/setup.sh installs Debian's chromium and "
                               "chromium-driver (run `make setup` as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="compass-chromium-", dir=scratch)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_text(driver, text: str, timeout: float = 60) -> None:
    """Wait until the rendered page contains `text` (the UI fills itself in after load)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while text not in driver.find_element(By.TAG_NAME, "body").text:
        if time.monotonic() > deadline:
            raise AssertionError(f"'{text}' not on {driver.current_url} after {timeout}s")
        time.sleep(0.5)


def open_tab(driver, name: str) -> None:
    """Click one of a page's tabs (the UI ignores a tab named in the URL on first load)."""
    from selenium.webdriver.common.by import By

    wait_for_text(driver, name)
    (tab,) = [e for e in driver.find_elements(By.CSS_SELECTOR, "li.p-tab") if e.text.strip() == name]
    tab.click()


SCROLLER = """
const boxes = [document.scrollingElement, ...document.querySelectorAll('*')].filter(e => e &&
    e.scrollHeight > e.clientHeight + 10 && (e === document.scrollingElement ||
    ['auto', 'scroll'].includes(getComputedStyle(e).overflowY)));
return boxes.sort((a, b) => b.scrollHeight - a.scrollHeight)[0] || document.scrollingElement;
"""


def text_while_scrolling(driver, pause: float = 0.3) -> str:
    """Everything the page shows from top to bottom: the UI renders long lists only as they scroll into view
    (inside its own scrolling container, not the window)."""
    from selenium.webdriver.common.by import By

    box = driver.execute_script(SCROLLER)
    seen: list[str] = []
    position = 0
    while True:
        driver.execute_script("arguments[0].scrollTop = arguments[1]", box, position)
        time.sleep(pause)
        seen.append(driver.find_element(By.TAG_NAME, "body").text)
        if position >= driver.execute_script("return arguments[0].scrollHeight - arguments[0].clientHeight", box):
            return "\n".join(seen)
        position += max(200, driver.execute_script("return arguments[0].clientHeight", box) * 2 // 3)
