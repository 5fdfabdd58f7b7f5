"""The book and JupyterLab in a real headless Chromium (Debian's chromium and chromedriver, driven
with Selenium): what a reader and a trainee see.

- Book, served from a local HTTP server with no internet: every page loads with no console error;
  a lesson's widget renders from the site's own JavaScript (its DOM is there and its screenshot is
  not blank); the search page finds a glossary term.
- JupyterLab on 127.0.0.1 with a token: lesson 01 opens, runs all its cells with no error output,
  and moving a slider of its batch calculator changes what the calculator shows.

Screenshots are kept in _build/browser/ and listed at the end of the test output.
"""
import functools
import http.server
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import SCREENSHOTS, debian_tool, free_port, kit_env
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from coursekit import KIT_ROOT

# the first book test may be the one that builds the book (conftest.built_book)
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1800)]

SCREENSHOT_DIR = KIT_ROOT / "_build" / "browser"
LESSON_01 = KIT_ROOT / "notebooks" / "01-single-gpu-gpt" / "01-single-gpu-gpt.ipynb"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium; its console messages are kept for get_log("browser")."""
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
    yield driver
    driver.quit()


def console_errors(driver):
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def wait_for(driver, condition, seconds, what):
    return WebDriverWait(driver, seconds, poll_frequency=0.5).until(condition, message=what)


def screenshot(element, name):
    """Save the element's screenshot; returns its share of pixels that are not background."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    png = element.screenshot_as_png
    path = SCREENSHOT_DIR / f"{name}.png"
    path.write_bytes(png)
    SCREENSHOTS.append(path)
    image = Image.open(io.BytesIO(png)).convert("L")
    background = max(image.histogram())  # the most common grey level
    return 1 - background / (image.width * image.height)


# --- the book ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def book_url(built_book):
    """The built book served over HTTP on 127.0.0.1, as a reader's browser would get it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=built_book)
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def book_pages(built_book):
    return sorted(str(p.relative_to(built_book)) for p in built_book.rglob("*.html")
                  if "_static" not in p.parts and "_sources" not in p.parts)


def test_every_book_page_loads_without_console_errors(browser, built_book, book_url):
    failures = {}
    for page in book_pages(built_book):
        browser.get(f"{book_url}/{page}")
        wait_for(browser, lambda d: d.execute_script("return document.readyState") == "complete",
                 30, f"{page} did not finish loading")
        time.sleep(0.5)  # scripts that run after the load event (widgets, search) log by now
        errors = console_errors(browser)
        if errors:
            failures[page] = errors
    assert len(book_pages(built_book)) >= 12 and not failures, failures


def test_a_lesson_widget_renders_from_the_sites_javascript(browser, book_url):
    browser.get(f"{book_url}/notebooks/04-model-parallelism/04-model-parallelism.html")
    calculator = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".widget-vbox"), 60,
                          "the memory calculator's widget box never rendered")[0]
    browser.execute_script("arguments[0].scrollIntoView()", calculator)
    sliders = calculator.find_elements(By.CSS_SELECTOR, ".widget-slider")
    dropdowns = calculator.find_elements(By.CSS_SELECTOR, ".widget-dropdown select")
    assert len(sliders) == 2 and len(dropdowns) == 4
    assert "GPT-2 124M" in calculator.text and "per rank" in calculator.text
    assert screenshot(calculator, "book-memory-calculator") > 0.02  # not a blank box
    assert not console_errors(browser)


def test_the_search_page_finds_a_glossary_term(browser, book_url):
    browser.get(f"{book_url}/search.html?q=Amdahl")
    results = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#search-results li a"),
                       60, "the search page listed no results for Amdahl")
    wait_for(browser, lambda d: "glossary" in " ".join(
        a.get_attribute("href") for a in d.find_elements(By.CSS_SELECTOR, "#search-results li a")),
        30, "the glossary is not among the search results for Amdahl")
    assert results


# --- JupyterLab ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a copy of lesson 01 on 127.0.0.1 with a token (the copy, so that its
    autosave cannot write outputs into the committed notebook); yields its URL and token."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(LESSON_01, root)
    port, token = free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ip", "127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=kit_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:  # until the server answers its REST API
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "JupyterLab did not start"
            time.sleep(0.5)
    yield url, token
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


NOTEBOOK = "window.jupyterapp.shell.currentWidget"  # the notebook panel in front
CELLS = f"""
const notebook = {NOTEBOOK}.content;
return notebook.widgets.filter(cell => cell.model.type === 'code').map(cell => ({{
    count: cell.model.executionCount,
    errors: cell.model.outputs.toJSON().filter(o => o.output_type === 'error')
                                     .map(o => o.ename + ': ' + o.evalue)}}));
"""


def test_jupyterlab_runs_lesson_01_and_its_calculator_answers_a_slider(browser, lab):
    url, token = lab
    browser.get(f"{url}/lab/tree/{LESSON_01.name}?token={token}")
    wait_for(browser, lambda d: d.execute_script(
        f"const w = window.jupyterapp && {NOTEBOOK};"
        "return !!(w && w.sessionContext && w.sessionContext.kernelDisplayStatus === 'idle');"),
        120, "lesson 01 did not open with an idle kernel")
    start = time.perf_counter()
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    def finished(driver):  # every cell ran, or one failed (Run All stops there)
        cells = driver.execute_script(CELLS)
        return any(c["errors"] for c in cells) or all(c["count"] for c in cells) and \
            driver.execute_script(f"return {NOTEBOOK}.sessionContext.kernelDisplayStatus === 'idle'")

    wait_for(browser, finished, 900, "lesson 01 was still running after 15 minutes")
    cells = browser.execute_script(CELLS)
    print(f"lesson 01 in JupyterLab: {len(cells)} code cells in {time.perf_counter() - start:.0f} s")
    assert [c for c in cells if c["errors"]] == []
    assert all(c["count"] for c in cells), "some cells did not run"
    screenshot(browser.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel"), "lab-lesson-01")

    calculator = next(box for box in browser.find_elements(By.CSS_SELECTOR, ".widget-vbox")
                      if "tokens per step" in box.text)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", calculator)
    shown = calculator.find_element(By.CSS_SELECTOR, ".widget-html").text
    assert "524,288 tokens per step" in shown
    handle = calculator.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[0]
    handle.click()
    handle.send_keys(Keys.ARROW_RIGHT)  # micro-batch 64 -> 65
    wait_for(browser, lambda d: calculator.find_element(By.CSS_SELECTOR, ".widget-html").text != shown,
             30, "moving the micro-batch slider did not change the calculator's output")
    assert "532,480 tokens per step" in calculator.find_element(By.CSS_SELECTOR, ".widget-html").text
    screenshot(calculator, "lab-batch-calculator")
