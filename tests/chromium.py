"""Headless Chromium for the browser tests (Debian's chromium and chromedriver, driven with
Selenium), and what they do with it: wait for a state of the page, take a screenshot."""
import io
import re
import shutil
import subprocess
import time
import urllib.request

from conftest import SCREENSHOT_DIR, debian_tool
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait


def headless():
    """Headless Chromium, until the generator is closed (a fixture's body); its console
    messages are kept for get_log("browser")."""
    debian_tool("chromium", "chromium", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver path is given, so Selenium Manager does not try to download one
    driver = webdriver.Chrome(service=Service(executable_path=debian_tool("chromedriver",
                                                                          "chromium-driver")),
                              options=options)
    driver.set_script_timeout(120)  # execute_async_script waits for typesetting and fonts
    yield driver
    driver.quit()


def console_errors(driver):
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait_for(driver, condition, seconds, what):
    # elements that a page re-renders while we look (search results, widgets) go stale: look again
    return WebDriverWait(driver, seconds, poll_frequency=0.5,
                         ignored_exceptions=[StaleElementReferenceException]).until(condition,
                                                                                    message=what)


def screenshot(element, name):
    """Save the element's screenshot; returns its share of pixels that are not background."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    png = element.screenshot_as_png
    path = SCREENSHOT_DIR / f"{name}.png"
    path.write_bytes(png)
    image = Image.open(io.BytesIO(png)).convert("L")
    background = max(image.histogram())  # the most common grey level
    return 1 - background / (image.width * image.height)


#: Where JupyterLab says it serves, in its log
LAB_ADDRESS = re.compile(r"http://127\.0\.0\.1:(\d+)/lab")


def start_lab(command, token, log, seconds=120, **popen):
    """Start JupyterLab by ``command`` on port 0, which the system picks when the server binds:
    no other process can take it between a choice and the bind, and the test can ask no other
    server. Returns (its Popen, its URL, read from its ``log``) once its REST API answers; fails
    at once if it exits first."""
    with open(log, "wb") as out:
        server = subprocess.Popen([*command, "--port=0"], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, **popen)
    deadline = time.monotonic() + seconds
    while not (found := LAB_ADDRESS.search(log.read_text(errors="replace"))):
        assert server.poll() is None and time.monotonic() < deadline, \
            "JupyterLab did not start:\n" + log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    url = f"http://127.0.0.1:{found[1]}"
    wait_until_lab_answers(url, token, server, seconds)
    return server, url


def wait_until_lab_answers(url, token, server, seconds=120):
    """Wait until the JupyterLab that `server` (its Popen) started at `url` answers its REST API;
    fail at once if it exits first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            return
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "JupyterLab did not start"
            time.sleep(0.5)  # the interval between two requests: the loop waits for an answer
