"""Lessons: jupytext pairs in sync, no outputs committed, lesson structure, and nbval on CPU."""
import json
import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.compare import NotebookDifference, compare_notebooks

from conftest import lesson_notebook, lessons_run_under_nbval, run_nbval
from coursekit import KIT_ROOT, book, grading, trainee

pytestmark = pytest.mark.notebooks
LESSONS = grading.lessons(KIT_ROOT)


def test_every_lesson_folder_has_a_notebook():
    folders = sorted(p.name for p in (KIT_ROOT / "notebooks").iterdir() if p.is_dir())
    assert folders == LESSONS and len(LESSONS) >= 2


@pytest.mark.parametrize("lesson", LESSONS)
def test_jupytext_pair_is_in_sync(lesson):
    ipynb = jupytext.read(lesson_notebook(lesson))
    py = jupytext.read(lesson_notebook(lesson).with_suffix(".py"))
    compare_notebooks(py, ipynb, fmt="py:percent")  # raises on any difference


def test_the_sync_check_catches_an_edit_on_one_side():
    lesson = LESSONS[0]
    py = jupytext.read(lesson_notebook(lesson).with_suffix(".py"))
    edited = jupytext.read(lesson_notebook(lesson))
    edited.cells[-1].source += "\n- an extra key point written only in the notebook"
    with pytest.raises(NotebookDifference):
        compare_notebooks(py, edited, fmt="py:percent")


@pytest.mark.parametrize("lesson", LESSONS)
def test_no_outputs_committed(lesson):
    cells = json.loads(lesson_notebook(lesson).read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_has_questions_objectives_time_exercises_and_key_points(lesson):
    cells = jupytext.read(lesson_notebook(lesson)).cells
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    for heading in ("**Questions.**", "**Objectives.**", "**Prerequisites.**", "**Time.**",
                    "## Key points"):
        assert heading in text
    # the questions open the lesson, beside its objectives (the Carpentries' lesson header)
    assert cells[0].cell_type == "markdown" and "**Questions.**" in cells[0].source
    questions = r"\*\*Questions\.\*\*[^\n]*\n(- .+\n(  .+\n)*){2,}\n\*\*Objectives"
    assert re.search(questions, cells[0].source)  # two questions or more, then the objectives
    graded = [c for c in cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) >= 3 and all(c.metadata["nbgrader"]["points"] > 0 for c in graded)
    assert any("### BEGIN HIDDEN TESTS" in c.source for c in graded)


def glossary_terms():
    """The terms of book/glossary.md, lower case, without a qualifier such as " (MLflow)"."""
    text = (KIT_ROOT / "book" / "glossary.md").read_text()
    body = text.split("```{glossary}", 1)[1].split("```", 1)[0]
    return {re.sub(r" \(.*\)$", "", line.strip()).lower()
            for line in body.splitlines() if line.strip() and not line[0].isspace()}


def bold_phrases(lesson):
    """The lesson's bold phrases, except run-in headings (**Time.**, **Exercise 3: ...**)."""
    cells = jupytext.read(lesson_notebook(lesson)).cells
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    phrases = {" ".join(found.split()) for found in re.findall(r"\*\*(.+?)\*\*", text, re.DOTALL)}
    return {p for p in phrases if not (p.endswith((".", "?")) or p.startswith("Exercise"))}


def in_glossary(phrase, terms):
    """``phrase`` is a term, or the plural of one."""
    phrase = phrase.lower()
    return any(form in terms for form in (phrase, phrase.removesuffix("s"), phrase.removesuffix("es")))


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_bold_term_of_a_lesson_is_in_the_glossary(lesson):
    """Bold marks a term the lesson introduces, which the glossary defines; emphasis is italic."""
    terms = glossary_terms()
    assert len(terms) >= 100
    assert sorted(p for p in bold_phrases(lesson) if not in_glossary(p, terms)) == []


def test_the_glossary_check_catches_a_missing_term():
    terms = glossary_terms()
    assert in_glossary("Buckets", terms) and in_glossary("FSDP", terms)
    assert not in_glossary("Flux capacitor", terms) and not in_glossary("every", terms)


#: Columns of code the book shows: a wider line is cut off, behind a scroll bar.
CODE_WIDTH = 88
#: Lines of a lesson's first code cell: its imports and a few settings a reader needs to see.
FIRST_CELL_LINES = 15


def lesson_code(lesson):
    """{where: its lines} of a lesson's code: each code cell, and each module kept beside the
    notebook (the plumbing a lesson does not teach, called from it in a line)."""
    cells = [cell for cell in jupytext.read(lesson_notebook(lesson)).cells
             if cell.cell_type == "code"]
    code = {f"code cell {n}": cell.source.splitlines() for n, cell in enumerate(cells)}
    folder = Path("notebooks") / lesson
    for path in trainee.tracked_files(KIT_ROOT):
        if path.parent == folder and path.suffix == ".py" and path.stem != lesson:
            code[path.name] = (KIT_ROOT / path).read_text().splitlines()
    return code


def wider_than_the_book(code):
    return [f"{where}: {line}" for where, lines in code.items() for line in lines
            if len(line) > CODE_WIDTH]


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_code_fits_the_books_width_and_opens_with_a_short_cell(lesson):
    code = lesson_code(lesson)
    assert wider_than_the_book(code) == []
    assert len(code["code cell 0"]) <= FIRST_CELL_LINES, "\n".join(code["code cell 0"])


def test_the_width_check_catches_a_wide_line():
    code = {"code cell 0": ["x = 1", "y = " + "1 + " * 22 + "1"]}  # 93 columns
    assert wider_than_the_book(code) == [f"code cell 0: {code['code cell 0'][1]}"]


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_runs_under_nbval(lesson, lesson_executions):
    """Every cell runs without error. The run is recorded and kept for the book (conftest's
    built_book), which shows these outputs instead of executing the lesson again."""
    assert lesson_executions.executed(lesson).is_file()


def test_the_record_of_a_lesson_is_what_the_books_executor_gives(tmp_path, lesson_executions,
                                                                 request):
    """The book shows nbval's records: a lesson recorded has the outputs (their kinds, cell by
    cell), execution counts, language and widget state that `make book`'s execution gives it."""
    lesson = LESSONS[0]  # a lesson with widgets, a plot and printed results
    if lesson in lessons_run_under_nbval(request.session):  # the record the book is built from
        record = lesson_executions.executed(lesson)
    else:
        record = tmp_path / "record.ipynb"
        run_nbval(lesson, record)
    recorded = nbformat.read(record, as_version=4)
    executed = book.executed(lesson_notebook(lesson), tmp_path / "cache", timeout=600)

    def shown(notebook):
        widgets = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]
        return (notebook.metadata["language_info"],
                sorted(state["model_name"] for state in widgets["state"].values()),
                [(cell.execution_count, [(output.output_type, output.get("name"),
                                          sorted(output.get("data", {})))
                                         for output in cell.outputs])
                 for cell in notebook.cells if cell.cell_type == "code"])

    assert shown(recorded) == shown(executed)
    assert any(cell.get("outputs") for cell in recorded.cells)
