"""What autograde and `coursekit grades --items` do with a class's work, without nbgrader: the
test cells a trainee deleted put back in their places, and each graded cell's statistics
(tests/test_class.py runs both through nbgrader with real users)."""
import copy

import nbformat
import pytest

from conftest import lesson_notebook
from coursekit import KIT_ROOT, grading

pytestmark = pytest.mark.unit
LESSONS = grading.lessons(KIT_ROOT)


@pytest.mark.parametrize("lesson", LESSONS)
def test_deleted_test_cells_are_put_back_where_the_release_has_them(lesson):
    """A submission without some of the lesson's test cells (the first, one in the middle and
    the last) gets them back, each in its place: the cells then run in the release's order."""
    release = nbformat.read(lesson_notebook(lesson), as_version=4)
    tests = [grading.grade_id(cell) for cell in release.cells if grading.is_test_cell(cell)]
    deleted = {tests[0], tests[len(tests) // 2], tests[-1]}
    submission = copy.deepcopy(release)
    submission.cells = [cell for cell in submission.cells if grading.grade_id(cell) not in deleted]
    put_back = grading.put_back_tests(release, submission)
    assert sorted(put_back) == sorted(deleted)
    assert [cell.source for cell in submission.cells] == [cell.source for cell in release.cells]
    assert grading.put_back_tests(release, submission) == []  # nothing more to put back


def pearson(xs, ys):
    """The correlation coefficient, from its definition."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return covariance / (sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5


def test_item_statistics_give_each_cells_mean_zeros_discrimination_and_commonest_error():
    exercises = [("easy", 2), ("hard", 4), ("flat", 1), ("unworked", 0)]
    scores = {"ann": {"easy": 2, "hard": 4, "flat": 1}, "ben": {"easy": 2, "hard": 1, "flat": 1},
              "cy": {"easy": 0, "hard": 0, "flat": 1}, "di": {"easy": 2, "hard": 0, "flat": 1}}
    rows = [(name, "on time", cells) for name, cells in scores.items()]
    rows.append(("eve", "missing", {}))  # not graded: in no figure
    errors = {"hard": ["AssertionError: 3", "NameError: x", "AssertionError: 3"],
              "easy": ["ZeroDivisionError: division by zero"]}
    items = grading.item_statistics(exercises, rows, errors)
    assert [item.grade_id for item in items] == ["hard", "easy", "flat"]  # lowest mean first
    hard, easy, flat = items
    assert (hard.mean, hard.at_zero, hard.error) == ((4 + 1) / 16, 0.5, ("AssertionError: 3", 2))
    assert (easy.mean, easy.at_zero, easy.error) == (6 / 8, 0.25,
                                                     ("ZeroDivisionError: division by zero", 1))
    # each against the rest of the total: ann 3, ben 3, cy 1, di 3 without "hard"
    assert hard.discrimination == pytest.approx(pearson([4, 1, 0, 0], [3, 3, 1, 3]))
    assert easy.discrimination == pytest.approx(pearson([2, 2, 0, 2], [5, 2, 1, 1]))
    assert (flat.mean, flat.at_zero, flat.discrimination, flat.error) == (1, 0, None, None)
    table = grading.items_table("00-x", items, 4).splitlines()
    assert table[0] == "00-x: each graded cell over 4 graded submissions, lowest mean first"
    assert table[2].split()[:5] == ["hard", "4", "31%", "50%", f"{hard.discrimination:+.2f}"]
    assert table[2].endswith("AssertionError: 3 (2)") and table[4].endswith("  -")


def test_a_notebook_rewritten_in_a_trainees_folder_follows_no_link_they_left(tmp_path):
    """A submission's folder holds what the trainee handed in, links included: the rewrite of
    their notebook writes a new temporary file, not through a link named as one would be."""
    victim = tmp_path / "gradebook.db"
    victim.write_text("the grader's")
    notebook = tmp_path / "00-x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), notebook)
    notebook.chmod(0o600)
    (tmp_path / ".00-x.ipynb.tmp").symlink_to(victim)
    grading.write_notebook(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]),
                           notebook)
    assert victim.read_text() == "the grader's"
    assert nbformat.read(notebook, as_version=4).cells[0].source == "1"
    assert notebook.stat().st_mode & 0o777 == 0o600
    assert {path.name for path in tmp_path.iterdir()} == {"gradebook.db", "00-x.ipynb",
                                                          ".00-x.ipynb.tmp"}
