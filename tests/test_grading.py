"""nbgrader: student versions hold no solutions or hidden tests; the solution scores full marks,
the untouched student version scores zero on every graded cell."""
import shutil

import jupytext
import pytest

from coursekit import KIT_ROOT, grading

pytestmark = pytest.mark.grading
LESSONS = grading.lessons(KIT_ROOT)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A copy of the course root with the student versions generated, as `make assignments` does."""
    root = tmp_path_factory.mktemp("course")
    shutil.copy(KIT_ROOT / "nbgrader_config.py", root)
    shutil.copytree(KIT_ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    grading.generate(root)
    return root


def source_blocks(lesson, begin, end):
    """The lines between begin and end markers in the lesson's source notebook."""
    blocks, inside = [], False
    for cell in jupytext.read(KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb").cells:
        for line in cell.source.splitlines():
            if begin in line:
                inside = True
            elif end in line:
                inside = False
            elif inside and line.strip():
                blocks.append(line.strip())
    return blocks


@pytest.mark.parametrize("lesson", LESSONS)
def test_release_holds_no_solutions_or_hidden_tests(course, lesson):
    released = {p.name for p in (course / "release" / lesson).iterdir()}
    assert f"{lesson}.ipynb" in released  # with the lesson's assets, if it has any
    assert f"{lesson}.py" not in released  # the jupytext pair holds the solutions
    text = (course / "release" / lesson / f"{lesson}.ipynb").read_text()
    solutions = source_blocks(lesson, "### BEGIN SOLUTION", "### END SOLUTION")
    hidden = source_blocks(lesson, "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
    assert solutions and hidden
    leaked = [line for line in solutions + hidden if line in text]
    assert leaked == []
    assert "raise NotImplementedError()" in text


@pytest.mark.parametrize("lesson", LESSONS)
def test_solution_scores_full_marks(course, lesson):
    scores = grading.autograde(course, lesson, "solution",
                               KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb")
    assert len(scores) >= 3
    assert {name: score for name, (score, _) in scores.items()} == \
           {name: maximum for name, (_, maximum) in scores.items()}


@pytest.mark.parametrize("lesson", LESSONS)
def test_untouched_student_version_scores_zero(course, lesson):
    scores = grading.autograde(course, lesson, "blank", course / "release" / lesson / f"{lesson}.ipynb")
    assert len(scores) >= 3 and all(score == 0 for score, _ in scores.values())
