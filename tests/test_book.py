"""The Jupyter Book: builds with warnings as errors, lessons executed, every page reachable."""
import json
import os
import re
import socket
from html import unescape
from pathlib import Path

import nbformat
import pytest
import yaml

from coursekit import KIT_ROOT, KitError, book, diffs, grading

# the first test builds the book (conftest.built_book), from nbval's executions of the lessons
# when the session runs nbval, executing them itself otherwise
pytestmark = [pytest.mark.book, pytest.mark.slow, pytest.mark.timeout(1800)]


def toc_files():
    toc = yaml.safe_load((KIT_ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


@pytest.fixture(scope="module")
def html(built_book):
    return built_book  # conftest: one build for these tests and the browser tests


def test_every_lesson_and_prose_chapter_is_in_the_table_of_contents():
    chapters = {str(p.relative_to(KIT_ROOT).with_suffix("")) for p in (KIT_ROOT / "book").glob("*.md")}
    lessons = {f"notebooks/{lesson}/{lesson}" for lesson in grading.lessons(KIT_ROOT)}
    assert len(lessons) >= 8 and sorted((chapters | lessons) - set(toc_files())) == []


def test_every_toc_entry_is_a_page_reachable_from_the_index(html):
    pages = {f"{name}.html" for name in toc_files()}
    assert all((html / page).is_file() for page in pages)
    reachable, todo = set(), ["book/intro.html"]
    while todo:
        page = todo.pop()
        if page in reachable or not (html / page).is_file():
            continue
        reachable.add(page)
        for link in re.findall(r'href="([^"#:]+\.html)', (html / page).read_text()):
            todo.append(os.path.normpath(os.path.join(os.path.dirname(page), link)))
    assert pages <= reachable


# what only an executed lesson shows: its printed results, and plots as images
EXECUTED_OUTPUTS = {
    "00-gpus-and-hpc": ["TFLOP/s"],
    "00b-deep-learning": ["dy/dx by autograd = 10.0", "parameters on 20 points:",
                          "early stopping (patience 20) keeps epoch", "GFLOP/s"],
    "01-single-gpu-gpt": ["tokens per step", "temperature 0.5"],
    "02-ddp": ["max |all-reduced - whole batch| =", "strong scaling: speedup",
               "final validation loss"],
    "03-lightning": ["ddp_notebook:", "resumed run identical to the uninterrupted one: True"],
    "04-model-parallelism": ["fsdp on 4 processes: largest loss difference from ddp",
                             "checkpointing:", "bubble predicted 0.33, measured",
                             "tp on 2 processes", "pp on 2 processes (1F1B)"],
    "05-llm-finetuning": ["B is zero at the start: True", "tokens count in the loss",
                          "W + (alpha/r) B A by hand vs the merged model",
                          "merged model vs base model + adapter: largest logit difference",
                          "FSDP on 2 processes: first loss"],
    "06-mlops": ["val_000000.npy changed", "weights_only=True refused it: WeightsUnpickler error",
                 "registered model kit-std version 1, alias champion", "exported Chrome trace"],
    "07-hpo": ["random search beats the grid 93%", "Optuna makes 5 brackets",
               "5 recipes of 3,072 tokens in", "and the same run directory: True"],
    "08-vision": ["512 images, files opened: 512 .jpg", "The slowest stage here is",
                  "predicted images/s", "waiting for its batch; validation accuracy",
                  "at initialisation: 21 weights, trust ratios from"],
    "09-ray-rag": ["8 tasks of 0.2 s in", "chunks embedded by 2 replicas in",
                   "random chunks of that size: MRR"],
    "10-debugging": ["find_unused_parameters: ", "made in forward by:", "grad_norm per step:",
                     "under 3 GB: "],
}


@pytest.mark.parametrize("lesson", grading.lessons(KIT_ROOT))
def test_lessons_are_executed_with_outputs(html, lesson):
    """Every lesson on disk: a new one fails here until EXECUTED_OUTPUTS names what it prints."""
    assert lesson in EXECUTED_OUTPUTS, f"{lesson}: name what only its execution shows"
    page = (html / "notebooks" / lesson / f"{lesson}.html").read_text()
    for text in EXECUTED_OUTPUTS[lesson]:
        assert html_text(text) in page
    plots = "plt.show()" in (KIT_ROOT / "notebooks" / lesson / f"{lesson}.py").read_text()
    assert ("<img" in page) == plots and "Traceback" not in page


@pytest.mark.parametrize("lesson", dict.fromkeys(step.lesson for step in diffs.LADDER))
def test_diff_lessons_show_every_hunk_highlighted(html, lesson):
    """Every hunk of every diff of the lesson (lesson 04 has three), as a highlighted block."""
    page = (html / "notebooks" / lesson / f"{lesson}.html").read_text()
    assert page.count('class="highlight-diff') == sum(
        len(diffs.hunks(lesson, stage=step.target)) for step in diffs.lesson_steps(lesson))


def html_text(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_tables_that_lessons_print_are_rendered_as_tables(html):
    page = (html / "notebooks" / "04-model-parallelism" / "04-model-parallelism.html").read_text()
    assert re.search(r"<th[^>]*>(<p>)?predicted MiB per rank", page)
    for lesson in grading.lessons(KIT_ROOT):  # a table left as text: a paragraph of | cells
        assert "<p>|" not in (html / "notebooks" / lesson / f"{lesson}.html").read_text()


# the lessons that show a widget, and its class in the saved widget state
WIDGET_LESSONS = {"00-gpus-and-hpc": "FloatSliderModel", "01-single-gpu-gpt": "IntProgressModel",
                  "02-ddp": "DropdownModel", "04-model-parallelism": "CheckboxModel"}


@pytest.mark.parametrize("lesson", WIDGET_LESSONS)
def test_widget_pages_load_their_javascript_from_the_site(html, lesson):
    page = (html / "notebooks" / lesson / f"{lesson}.html").read_text()
    assert 'application/vnd.jupyter.widget-state+json' in page and WIDGET_LESSONS[lesson] in page
    scripts = re.findall(r'<script[^>]*src="([^"]+)"', page)
    local = [src for src in scripts if "widgets" in src]
    assert [src.rsplit("/", 1)[-1].split("?")[0] for src in local] == \
        ["require.js", "widgets-setup.js", "embed-amd.js"]
    assert all((html / "notebooks" / lesson / src.split("?")[0]).resolve().is_file() for src in local)
    assert not [src for src in scripts if "://" in src], "a page loads a script from the internet"


def test_no_page_loads_a_script_or_stylesheet_from_the_internet(html):
    online = {}
    for page in html.rglob("*.html"):
        found = re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https?://[^"]+)"', page.read_text())
        if found:
            online[str(page.relative_to(html))] = found
    assert online == {}  # MathJax and the widget manager are served from _static/


def test_every_page_names_an_icon_the_site_has(html):
    """A page without one, the root's redirect included, makes the browser ask for /favicon.ico:
    a 404 in its console (test_browser sees it only when the icon is fetched in time)."""
    pages = [p for p in html.rglob("*.html") if "_static" not in p.parts]
    icons = {str(page.relative_to(html)): re.findall(r'<link rel="icon" href="([^"]+)"',
                                                     page.read_text()) for page in pages}
    assert len(pages) >= 12 and "index.html" in icons
    assert {page: found for page, found in icons.items()
            if len(found) != 1 or not (html / Path(page).parent / found[0]).is_file()} == {}


def test_search_index_is_built(html):
    assert (html / "search.html").is_file() and (html / "searchindex.js").is_file()


# --- the two editions: the reader's never shows an answer ----------------------------------------
MARKERS = {"### BEGIN SOLUTION": "### END SOLUTION", "### BEGIN HIDDEN TESTS": "### END HIDDEN TESTS"}


def split_lines(notebook):
    """(marked, visible): the stripped lines of a source notebook's solution and hidden-test
    regions (markers included), and all its other lines."""
    marked, visible = set(), set()
    for cell in nbformat.read(notebook, as_version=4).cells:
        end = None
        for line in cell.source.splitlines():
            line = line.strip()
            if end is None and line in MARKERS:
                end = MARKERS[line]
            (marked if end else visible).add(line)
            if line == end:
                end = None
    return marked, visible


def secret_lines():
    """{lesson: lines only its solutions and hidden tests hold}, none shorter than 6 characters:
    none that the lessons show elsewhere (an import, `return total`), nor that the stage scripts
    hold (lessons print and diff them), nor that the prose chapters quote (the instructor's guide
    names the markers)."""
    split = {path.parent.name: split_lines(path) for path in book.lesson_notebooks(KIT_ROOT)}
    shown = "\n".join(line for _, visible in split.values() for line in visible)
    shown += "".join(path.read_text() for path in (KIT_ROOT / "solutions").glob("*.py"))
    shown += "".join(chapter.read_text() for chapter in (KIT_ROOT / "book").glob("*.md"))
    return {lesson: {line for line in marked if len(line) >= 6 and line not in shown}
            for lesson, (marked, _) in split.items()}


def readable_text(path):
    """What a reader can get from a file of the site: a page's text (tags removed, so that
    highlighted code reads as its lines), a notebook download's cells, any other file as is."""
    raw = path.read_text(errors="replace")
    if path.suffix == ".html":
        return unescape(re.sub(r"<[^>]+>", "", raw))
    if path.suffix == ".ipynb":
        notebook = nbformat.reads(raw, as_version=4)
        return "\n".join(cell.source for cell in notebook.cells) + raw
    return raw


def site_text(site):
    return {str(path.relative_to(site)): readable_text(path) for path in site.rglob("*")
            if path.is_file() and path.suffix in (".html", ".js", ".ipynb", ".txt", ".md", ".json")}


def test_every_lesson_has_lines_only_its_answers_hold():
    assert all(len(lines) >= 3 for lines in secret_lines().values())


def test_the_readers_edition_shows_no_solution_or_hidden_test(html):
    texts = site_text(html)
    leaks = {(lesson, line, name) for lesson, lines in secret_lines().items() for line in lines
             for name, text in texts.items() if line in text}
    assert sorted(leaks)[:20] == []
    lesson_pages = [text for name, text in texts.items() if name.startswith("notebooks/")
                    and name.endswith(".html")]
    assert len(lesson_pages) == len(secret_lines())
    assert all("raise NotImplementedError()" in page and not any(marker in page for marker in MARKERS)
               for page in lesson_pages)


def test_no_page_shows_the_builders_paths_host_or_jobs(html):
    """What the builder's own machine and account show is not published: no page, search index or
    downloadable notebook holds the kit's absolute path or the home directory, no output the
    host's name, and the cells tagged to leave their output out (the kernel's report, the Slurm
    cells) have none in the downloads either."""
    texts = site_text(html)
    found = {(name, path) for name, text in texts.items()
             for path in (str(KIT_ROOT), str(Path.home())) if path in text}
    assert sorted(found)[:20] == []
    host = re.compile(rf"\b{re.escape(socket.gethostname())}\b")
    left_out = 0
    for download in (html / "_sources" / "notebooks").rglob("*.ipynb"):
        for cell in nbformat.read(download, as_version=4).cells:
            shown = "\n".join(part for output in cell.get("outputs", []) for part in (
                [output.get("text", "")] + [value for mime, value in output.get("data", {}).items()
                                            if mime.startswith("text/")]))
            assert not host.search(shown), (download.name, cell.source[:80])
            if book.PRIVATE_OUTPUT_TAG in cell.metadata.get("tags", []):
                assert cell.outputs == [], (download.name, cell.source[:80])
                left_out += 1
    assert left_out >= 3  # lesson 00's kernel report and Slurm cell, lesson 07's job array


def test_the_instructors_edition_shows_every_solution_and_hidden_test(instructor_book):
    for lesson, lines in secret_lines().items():
        page = readable_text(instructor_book / "notebooks" / lesson / f"{lesson}.html")
        assert sorted(line for line in lines if line not in page) == []
        assert "instructor's edition" in page


#: A word that a page shows as the Markdown source has it (no markup around it, no "--" or "..."
#: that Sphinx turns into a dash or an ellipsis)
PLAIN_WORD = re.compile(r"(?!.*(--|\.\.\.))[\w.,;:!?'\"()%/+=-]+")


def instructors_notes(lesson):
    """The longest run of plain words in each instructor's note of ``lesson``, lists' bullets
    left out."""
    notebook = nbformat.read(KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb", as_version=4)
    phrases = []
    for cell in notebook.cells:
        if grading.INSTRUCTOR_TAG in cell.metadata.get("tags", []):
            body = [line.strip().removeprefix("- ") for line in cell.source.splitlines()[2:-1]]
            runs, run = [], []
            for word in " ".join(body).split():
                run = run + [word] if PLAIN_WORD.fullmatch(word) else []
                runs.append(run)
            phrases.append(" ".join(max(runs, key=len)))
    return phrases


#: Sphinx's smart quotes, as the straight ones the sources have
STRAIGHT_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def folded(text):
    return " ".join(text.translate(STRAIGHT_QUOTES).split())


def test_instructors_notes_show_in_the_instructors_edition_alone(html, instructor_book):
    reader_site = folded("\n".join(site_text(html).values()))
    for path in book.lesson_notebooks(KIT_ROOT):
        lesson = path.parent.name
        notes = instructors_notes(lesson)
        instructor_page = folded(readable_text(instructor_book / "notebooks" / lesson /
                                               f"{lesson}.html"))
        assert notes and min(len(note.split()) for note in notes) >= 5, (lesson, notes)
        assert [note for note in notes if note not in instructor_page] == []
        assert [note for note in notes if note in reader_site] == []


def one_cell_lesson(folder, name, code):
    """A notebook ``name`` in ``folder`` whose one cell is ``code``."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    path = folder / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def lesson_that_sleeps(folder, name, code):
    """A notebook ``name`` whose one cell writes when it started and ended, around ``code``."""
    written = f"pathlib.Path('{name}.times').write_text(f'{{started}} {{time.time()}}')"
    return one_cell_lesson(folder, name,
                           f"import time, pathlib\nstarted = time.time()\n{code}\n{written}")


# what the kernel executing a lesson can tell of how others could reach it
KERNELS_REACH = """
import json, os, pathlib, psutil
from ipykernel.connect import get_connection_info
info = get_connection_info(unpack=True)
folder = os.path.dirname(info["ip"])  # of its sockets, over IPC
pathlib.Path("reach.json").write_text(json.dumps({
    "transport": info["transport"], "folder": folder,
    "mode_and_owner": folder and [os.stat(folder).st_mode & 0o777, os.stat(folder).st_uid],
    "listening": [connection.laddr for connection in psutil.Process().net_connections("inet")
                  if connection.status == psutil.CONN_LISTEN]}))
"""


def test_the_books_kernels_listen_on_no_port_and_keep_their_sockets_private(tmp_path):
    """On a shared login node, a kernel's TCP ports would let any user subscribe to all that a
    lesson prints while `make book` executes it: the book's kernels use Unix sockets, in a folder
    of the builder's own that goes when the lesson ends."""
    book.executed(one_cell_lesson(tmp_path, "reach", KERNELS_REACH), tmp_path / "cache", 60)
    reach = json.loads((tmp_path / "reach.json").read_text())
    # over TCP, 6 ports: the 5 channels and ipykernel's pipe for the output of forked processes,
    # which drops every message without the kernel's key; over IPC, that pipe alone
    assert reach["transport"] == "ipc" and len(reach["listening"]) <= 1, reach
    assert reach["mode_and_owner"] == [0o700, os.getuid()]
    assert not Path(reach["folder"]).exists()


def test_lessons_without_an_execution_run_two_at_a_time_into_the_cache(tmp_path):
    lessons = [lesson_that_sleeps(tmp_path, name, "time.sleep(3)") for name in ("a", "b")]
    book.execute_missing(lessons, tmp_path / "cache", timeout=60, at_once=2)
    (a_start, a_end), (b_start, b_end) = (
        map(float, (tmp_path / f"{name}.times").read_text().split()) for name in ("a", "b"))
    assert a_start < b_end and b_start < a_end  # side by side
    assert all(book.has_execution(lesson, tmp_path / "cache") for lesson in lessons)


def test_a_lesson_that_fails_to_execute_is_named_and_the_ones_after_it_are_not_run(tmp_path):
    lessons = [lesson_that_sleeps(tmp_path, name, code) for name, code in (
        ("first", "time.sleep(1)"), ("second", "time.sleep(5)"), ("failing", "1 / 0"))]
    with pytest.raises(KitError, match=r"^failing\.ipynb failed to execute:"):
        book.execute_missing(lessons, tmp_path / "cache", timeout=60, at_once=2)  # last first
    assert not (tmp_path / "first.times").exists()  # cancelled before it started
