"""Headless Chromium for tests of the timeline's HTML page, driven through WebDriver (selenium).

Why WebDriver (selenium from PyPI, a dev dependency, with Debian's ``chromium-driver``) rather
than the DevTools protocol by hand: it is the W3C standard way to drive a browser, its actions
move a real pointer (so hovering runs the page's own ``mousemove`` handlers), and selenium is
maintained by the browser vendors' project; speaking DevTools directly would mean writing and
keeping a protocol client in this repo.  Nothing is downloaded: the browser and the driver are
Debian's (tools/setup.sh installs them when root), named by path, so Selenium Manager is not used.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")
#: Collects the page's uncaught script errors from before its first script runs.
ERROR_HOOK = ("window.__errors = [];"
              "window.addEventListener('error', function (e) { window.__errors.push(String(e.message)); });"
              "window.addEventListener('unhandledrejection',"
              " function (e) { window.__errors.push(String(e.reason)); });")


def why_not() -> str | None:
    """Why a browser test cannot run here (None when it can)."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (a dev dependency: pip install -e '.[dev]')"
    for binary, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian package {package}; tools/setup.sh installs it as root)"
    return None


def open_page(page: Path, profile: Path) -> Any:
    """A headless Chromium showing ``page`` (a fresh profile in ``profile``); the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": ERROR_HOOK})
        driver.get(page.resolve().as_uri())
    except BaseException:
        driver.quit()
        raise
    return driver


def script_errors(driver: Any) -> list[str]:
    """Uncaught errors of the page's scripts, and severe entries of the browser's console."""
    errors = list(driver.execute_script("return window.__errors || [];"))
    errors += [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    return errors
