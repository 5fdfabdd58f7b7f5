"""Lessons: jupytext pairs in sync, no outputs committed, lesson structure, and nbval on CPU."""
import json
import subprocess
import sys
import time

import jupytext
import pytest
from jupytext.compare import NotebookDifference, compare_notebooks

from coursekit import KIT_ROOT, grading

pytestmark = pytest.mark.notebooks
LESSONS = grading.lessons(KIT_ROOT)


def notebook_path(lesson):
    return KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb"


def test_every_lesson_folder_has_a_notebook():
    folders = sorted(p.name for p in (KIT_ROOT / "notebooks").iterdir() if p.is_dir())
    assert folders == LESSONS and len(LESSONS) >= 2


@pytest.mark.parametrize("lesson", LESSONS)
def test_jupytext_pair_is_in_sync(lesson):
    ipynb = jupytext.read(notebook_path(lesson))
    py = jupytext.read(notebook_path(lesson).with_suffix(".py"))
    compare_notebooks(py, ipynb, fmt="py:percent")  # raises on any difference


def test_the_sync_check_catches_an_edit_on_one_side():
    lesson = LESSONS[0]
    py = jupytext.read(notebook_path(lesson).with_suffix(".py"))
    edited = jupytext.read(notebook_path(lesson))
    edited.cells[-1].source += "\n- an extra key point written only in the notebook"
    with pytest.raises(NotebookDifference):
        compare_notebooks(py, edited, fmt="py:percent")


@pytest.mark.parametrize("lesson", LESSONS)
def test_no_outputs_committed(lesson):
    cells = json.loads(notebook_path(lesson).read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_has_objectives_time_exercises_and_key_points(lesson):
    cells = jupytext.read(notebook_path(lesson)).cells
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    for heading in ("**Objectives.**", "**Prerequisites.**", "**Time.**", "## Key points"):
        assert heading in text
    graded = [c for c in cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) >= 3 and all(c.metadata["nbgrader"]["points"] > 0 for c in graded)
    assert any("### BEGIN HIDDEN TESTS" in c.source for c in graded)


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_runs_under_nbval(lesson, tmp_path):
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider",
                             str(notebook_path(lesson))], capture_output=True, text=True,
                            cwd=notebook_path(lesson).parent, timeout=900)
    print(f"nbval {lesson}: {time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
