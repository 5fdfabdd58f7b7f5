"""The book and JupyterLab in a real headless Chromium (Debian's chromium and chromedriver, driven
with Selenium): what a reader and a trainee see.

- Book, served from a local HTTP server with no internet: every page loads with no console error;
  a lesson's widget renders from the site's own JavaScript (its DOM is there and its screenshot is
  not blank); the search page finds a glossary term.
- JupyterLab on 127.0.0.1 with a token: a lesson (LAB_LESSON) opens, runs all its cells with no
  error output, and moving a slider of its scaling calculator changes what the calculator shows.

Every wait is for a state of the page (loaded, widgets rendered, formulas typeset, fonts loaded, a
cell's output changed), never for a length of time.

Screenshots are kept in _build/browser/ and listed at the end of the test output.
"""
import functools
import http.server
import os
import secrets
import shutil
import signal
import threading
import time

import pytest
import chromium
from chromium import console_errors, screenshot, start_lab, wait_for
from conftest import kit_env
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from coursekit import KIT_ROOT, launch

# the first book test may be the one that builds the book (conftest.built_book)
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1800)]

#: The lesson JupyterLab runs from start to end, its third execution in a test run (after nbval and
#: the book's build): the shortest lesson (about 10 s), whose scaling calculator shows a widget.
LAB_LESSON = KIT_ROOT / "notebooks" / "00-gpus-and-hpc" / "00-gpus-and-hpc.ipynb"


@pytest.fixture(scope="module")
def browser():
    yield from chromium.headless()


# --- the book ------------------------------------------------------------------------------------

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # a line per request on stderr would bury the test's output
        pass


@pytest.fixture(scope="module")
def book_url(built_book):
    """The built book served over HTTP on 127.0.0.1, as a reader's browser would get it."""
    handler = functools.partial(QuietHandler, directory=built_book)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def book_pages(built_book):
    return sorted(str(p.relative_to(built_book)) for p in built_book.rglob("*.html")
                  if "_static" not in p.parts and "_sources" not in p.parts)


# The widget manager puts a .widget-subarea before each view's script tag and attaches the
# rendered view in it; a box's children follow in promise callbacks, which finish before the next
# script WebDriver runs.
WIDGETS_RENDERED = """
return [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')]
    .every(tag => tag.previousElementSibling?.matches('.widget-subarea')
                  && tag.previousElementSibling.firstElementChild !== null);
"""
# MathJax 3 chains every typesetting (the page's and the widgets') onto startup.promise. A frame
# later, layout has asked for every font the page uses, and document.fonts.ready waits for them.
TYPESET_AND_FONTS = """
const done = arguments[arguments.length - 1];
const typeset = window.MathJax?.startup?.promise ?? Promise.resolve();
typeset.then(() => new Promise(frame => requestAnimationFrame(frame)))
       .then(() => document.fonts.ready)
       .then(() => done(''), error => done(`typesetting or font loading failed: ${error}`));
"""


def load_and_settle(driver, url):
    """Open a book page and wait until what its scripts do after the load event is done: widgets
    rendered, formulas typeset, fonts loaded (a missing one is a console error). Returns what did
    not finish, if anything."""
    driver.get(url)
    for script, failure in [("return document.readyState === 'complete'", "it did not load"),
                            (WIDGETS_RENDERED, "its widgets did not render")]:
        try:
            WebDriverWait(driver, 60, poll_frequency=0.2).until(lambda d: d.execute_script(script))
        except TimeoutException:
            return [f"{failure} within 60 s"]
    unfinished = driver.execute_async_script(TYPESET_AND_FONTS)
    return [unfinished] if unfinished else []


def test_every_book_page_loads_without_console_errors(browser, built_book, book_url):
    failures = {}
    for page in book_pages(built_book):
        errors = load_and_settle(browser, f"{book_url}/{page}") + console_errors(browser)
        if errors:
            failures[page] = errors
    assert len(book_pages(built_book)) >= 12 and not failures, failures


def test_a_lesson_widget_renders_from_the_sites_javascript(browser, book_url):
    page = f"{book_url}/notebooks/04-model-parallelism/04-model-parallelism.html"
    assert not load_and_settle(browser, page)

    def whole_calculator(driver):  # the memory calculator's box, once all its controls are in it
        for box in driver.find_elements(By.CSS_SELECTOR, ".widget-vbox"):
            controls = (len(box.find_elements(By.CSS_SELECTOR, ".widget-slider")),
                        len(box.find_elements(By.CSS_SELECTOR, ".widget-dropdown select")))
            if "per rank" in box.text and controls == (2, 4):
                return box
        return None

    calculator = wait_for(browser, whole_calculator, 60, "the memory calculator's box never "
                          "rendered with its 2 sliders and 4 drop-downs")
    browser.execute_script("arguments[0].scrollIntoView()", calculator)
    assert "GPT-2 124M" in calculator.text
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
    """JupyterLab serving a copy of LAB_LESSON on 127.0.0.1 with a token (the copy, so that its
    autosave cannot write outputs into the committed notebook); yields its URL and token."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(LAB_LESSON, root)
    token = secrets.token_hex(16)
    server, url = start_lab(launch.lab_command(  # as `make lab` starts it: kernels over IPC
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True"), token, tmp_path_factory.mktemp("lab-log") / "log",
        env=kit_env({"JUPYTER_RUNTIME_DIR": launch.lab_runtime_dir()}))
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


# The lesson's scaling calculator, for a job of 80 h on 1 GPU and 22 h on 4: by hand, the
# Karp-Flatt serial fraction is (22/80 - 1/4) / (1 - 1/4) = 1/30, 3.3% on the slider's 0.1% steps,
# so Amdahl's limit is 1/0.033 = 30.3 and the speedup on 64 processes 1 / (0.033 + 0.967/64) =
# 20.8; one step right on the processes slider gives 65 processes, 1 / (0.033 + 0.967/65) = 20.9.
CALCULATOR_DEFAULT = ("speedup on 64 processes: 20.8", "limit with any number: 30.3")
CALCULATOR_MOVED = "speedup on 65 processes: 20.9"


def test_jupyterlab_runs_the_lesson_and_its_calculator_answers_a_slider(browser, lab):
    url, token = lab
    lesson = LAB_LESSON.stem
    browser.get(f"{url}/lab/tree/{LAB_LESSON.name}?token={token}")
    wait_for(browser, lambda d: d.execute_script(
        f"const w = window.jupyterapp && {NOTEBOOK};"
        "return !!(w && w.sessionContext && w.sessionContext.kernelDisplayStatus === 'idle');"),
        120, f"{lesson} did not open with an idle kernel")
    start = time.perf_counter()
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

    def finished(driver):  # every cell ran, or one failed (Run All stops there)
        cells = driver.execute_script(CELLS)
        return any(c["errors"] for c in cells) or all(c["count"] for c in cells) and \
            driver.execute_script(f"return {NOTEBOOK}.sessionContext.kernelDisplayStatus === 'idle'")

    wait_for(browser, finished, 900, f"{lesson} was still running after 15 minutes")
    cells = browser.execute_script(CELLS)
    print(f"{lesson} in JupyterLab: {len(cells)} code cells in {time.perf_counter() - start:.0f} s")
    assert [c for c in cells if c["errors"]] == []
    assert all(c["count"] for c in cells), "some cells did not run"
    screenshot(browser.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel"), f"lab-{lesson}")

    def calculator_output(driver):  # the kernel is idle before the front end renders its widgets
        for box in driver.find_elements(By.CSS_SELECTOR, ".widget-vbox"):
            shown = box.find_elements(By.CSS_SELECTOR, ".widget-html")
            if shown and "speedup on" in shown[0].text:
                return box
        return None

    calculator = wait_for(browser, calculator_output, 60, "the scaling calculator did not render")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", calculator)
    shown = calculator.find_element(By.CSS_SELECTOR, ".widget-html").text
    assert all(text in shown for text in CALCULATOR_DEFAULT), shown
    # the second slider (the first is the serial fraction)
    processes = calculator.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[1]
    processes.click()
    processes.send_keys(Keys.ARROW_RIGHT)  # 64 -> 65
    wait_for(browser, lambda d: calculator.find_element(By.CSS_SELECTOR, ".widget-html").text != shown,
             30, "moving the processes slider did not change the calculator's output")
    assert CALCULATOR_MOVED in calculator.find_element(By.CSS_SELECTOR, ".widget-html").text
    screenshot(calculator, "lab-scaling-calculator")
