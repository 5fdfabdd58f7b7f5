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


def marked_and_unmarked_lines(lesson):
    """The source notebook's non-blank lines inside solution and hidden-test blocks, and outside."""
    marked, unmarked, inside = set(), set(), False
    for cell in jupytext.read(KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb").cells:
        for line in (line.strip() for line in cell.source.splitlines()):
            if line in ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS"):
                inside = True
            elif line in ("### END SOLUTION", "### END HIDDEN TESTS"):
                inside = False
            elif line:
                (marked if inside else unmarked).add(line)
    return marked, unmarked


@pytest.mark.parametrize("lesson", LESSONS)
def test_release_holds_no_solutions_or_hidden_tests(course, lesson):
    released = {p.name for p in (course / "release" / lesson).iterdir()}
    assert f"{lesson}.ipynb" in released  # with the lesson's assets, if it has any
    assert f"{lesson}.py" not in released  # the jupytext pair holds the solutions
    cells = jupytext.read(course / "release" / lesson / f"{lesson}.ipynb").cells
    released_lines = {line.strip() for cell in cells for line in cell.source.splitlines()}
    marked, unmarked = marked_and_unmarked_lines(lesson)
    assert marked and "### BEGIN HIDDEN TESTS" not in released_lines
    # a marked line may also appear unmarked (a closing bracket, `pass`): only the others count
    assert sorted((marked - unmarked) & released_lines) == []
    assert "raise NotImplementedError()" in released_lines


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
