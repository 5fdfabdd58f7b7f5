"""nbgrader for the lessons: every folder in notebooks/ is an assignment, its notebook the source.

The course root holds nbgrader_config.py; `generate` writes student versions to release/,
`autograde` grades submitted notebooks and returns their per-cell scores from the gradebook.

Autograde runs only what grading needs. Cells tagged ``demo`` (training runs, launches, plots of
runs: what a lesson shows but no exercise needs) are not executed when grading; nbval and the
book still run them. `GradedCellsRun` keeps a submission from tagging a graded cell away.

What autograde runs is trainees' code: it runs in the grading kernel, a sandbox that sees no
gradebook, no other submission and none of the grader's files (coursekit/sandbox.py).
`OwnerCheckedCollect` refuses a submission handed in under another trainee's name.
`restore_deleted_tests` puts back the test cells a trainee deleted, which nbgrader would score 0.
"""
import os
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from nbgrader.exchange.default import ExchangeCollect, ExchangeReleaseFeedback
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor

from coursekit import KitError
from coursekit.diffs import WORKING_COPIES

#: The cell tag that autograde skips (nbgrader_config.py sets it as Execute.skip_cells_with_tag).
DEMO_TAG = "demo"
#: The cell tag of an instructor's note inside a lesson (a Markdown cell where the point applies):
#: the instructor's edition of the book shows it; student versions and the reader's edition drop
#: the cell (remove_instructor_notes).
INSTRUCTOR_TAG = "instructor"
#: The kernel autograde runs submissions in (coursekit/jupyter/kernels/, coursekit/sandbox.py).
GRADING_KERNEL = "coursekit-grading"


def lessons(root):
    """Lesson folders (assignment names) that have a notebook, in order."""
    return sorted(p.name for p in (Path(root) / "notebooks").iterdir()
                  if p.is_dir() and (p / f"{p.name}.ipynb").exists())


class GradedCellsRun(NbGraderPreprocessor):
    """Takes the demo tag off every graded, solution or locked cell of a submission, so that a
    student cannot skip a test by tagging it; runs among autograde's sanitising steps."""

    def preprocess_cell(self, cell, resources, index):
        nbgrader = cell.metadata.get("nbgrader", {})
        tags = cell.metadata.get("tags", [])
        if DEMO_TAG in tags and any(nbgrader.get(kind) for kind in ("grade", "solution", "locked")):
            cell.metadata["tags"] = [tag for tag in tags if tag != DEMO_TAG]
        return cell, resources


class OwnerCheckedCollect(ExchangeCollect):
    """nbgrader's collect, except that a submission whose folder in the exchange belongs to
    another user than the trainee it names is an error, where nbgrader's own only warns: it is
    not collected, even when it is the latest under that name (the trainee's own latest is), and
    once the others are collected the command fails naming it (nbgrader_config.py). (``fail``
    logs the message and raises nbgrader's ExchangeError.)"""

    def init_src(self):
        self.forged = []
        super().init_src()

    def _path_to_record(self, path):
        record = super()._path_to_record(path)
        record["owner"] = owner_name(Path(path))
        if record["owner"] != record["username"]:
            self.forged.append(record)
        return record

    def _sort_by_timestamp(self, records):
        # nbgrader collects the first of each trainee's submissions in this order: their own
        # latest, never a later one that someone else handed in under their name
        return sorted(records, key=lambda record: (record["owner"] == record["username"],
                                                   record["timestamp"]), reverse=True)

    def copy_files(self):
        self.src_records = [record for record in self.src_records
                            if record["owner"] == record["username"]]
        super().copy_files()
        if self.forged:
            self.fail("not collected, as each names a trainee who does not own it: " +
                      ", ".join(f"{record['filename']} (owned by {record['owner']})"
                                for record in self.forged))


class ReadableFeedbackRelease(ExchangeReleaseFeedback):
    """nbgrader's release_feedback, except that the released files can be read by the trainees
    they are for: nbgrader copies them with the mode of the instructor's own feedback files,
    private (nbgrader_config.py), and so trainees could not fetch them. What keeps each from the
    other trainees is its name, a hash of its submission's secret, in a folder nobody can list."""

    def copy_files(self):
        super().copy_files()
        for released in Path(self.dest_path).glob("*.html"):
            released.chmod(0o644)


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """Feedback shows each test cell as trainees got it: the hidden tests removed from its source
    and, where a test failed, the error's last line alone (its traceback quotes the failing line,
    which may be a hidden one). Hidden tests stay hidden after the course too, for the next."""

    def preprocess_cell(self, cell, resources, index):
        cell, resources = super().preprocess_cell(cell, resources, index)
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources


def remove_instructor_notes():
    """nbconvert's TagRemovePreprocessor, set to drop the cells tagged INSTRUCTOR_TAG."""
    from nbconvert.preprocessors import TagRemovePreprocessor
    return TagRemovePreprocessor(remove_cell_tags={INSTRUCTOR_TAG}, enabled=True)


class WithoutInstructorNotes(NbGraderPreprocessor):
    """Student versions leave out the instructor's notes: the first of generate_assignment's
    steps (nbgrader_config.py)."""

    def preprocess(self, nb, resources):
        return remove_instructor_notes().preprocess(nb, resources)


def generate_preprocessors():
    """`WithoutInstructorNotes`, then nbgrader's own steps for a student version."""
    from nbgrader.converters import GenerateAssignment
    return [WithoutInstructorNotes,
            *GenerateAssignment.class_traits()["preprocessors"].default()]


def feedback_preprocessors():
    """nbgrader's feedback steps, after `FeedbackWithoutHiddenTests`."""
    from nbgrader.converters import GenerateFeedback
    return [FeedbackWithoutHiddenTests,
            *GenerateFeedback.class_traits()["preprocessors"].default()]


def owner_name(path):
    uid = path.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"user id {uid}"


def sanitize_preprocessors():
    """nbgrader's own sanitising steps for autograde, then `GradedCellsRun`."""
    from nbgrader.converters import Autograde
    return [*Autograde.class_traits()["sanitize_preprocessors"].default(), GradedCellsRun]


def nbgrader(root, *args, check=True):
    """Run an nbgrader command in the course root; a failure is a KitError with nbgrader's log
    (unless ``check`` is false)."""
    # nbgrader runs the `alembic` command of its own environment to create the gradebook
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=root, env=env,
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise KitError(f"nbgrader {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


#: How nbgrader logs a submission it could not grade: the submission's folder, then, as the next
#: log line, the error's traceback (up to the line after).
NOT_GRADED = re.compile(r"There was an error processing assignment: (?P<folder>\S+)\n"
                        r"\[\w+ \| ERROR\] Traceback \(most recent call last\):\n"
                        r"(?P<traceback>.*?)(?=^\[|\Z)", re.DOTALL | re.MULTILINE)


def autograde_class(root, lesson):
    """`nbgrader autograde` of every submission of ``lesson`` in root/submitted/ not graded yet.
    nbgrader grades the others when one fails (a graded cell renamed or deleted, say): {trainee:
    nbgrader's own error, its last line} of those it could not grade."""
    result = nbgrader(root, "autograde", lesson, check=False)
    failed = {Path(found["folder"]).parent.name: found["traceback"].strip().splitlines()[-1].strip()
              for found in NOT_GRADED.finditer(result.stderr)}
    if result.returncode != 0 and not failed:
        raise KitError(f"nbgrader autograde {lesson} failed:\n{result.stderr[-3000:]}")
    return failed


def is_test_cell(cell):
    """A graded cell that is not an answer: the tests nbgrader runs on the cells above it."""
    meta = cell.metadata.get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def grade_id(cell):
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def cell_key(cell):
    """What finds a release's cell in a submission: its grade id, else its cell id (kept by
    Jupyter), else a key that no other cell has."""
    return grade_id(cell) or (f"id:{cell['id']}" if cell.get("id") else object())


def put_back_tests(release, submission):
    """Insert into ``submission`` (an nbformat notebook) each test cell of ``release`` it lacks,
    after the nearest cell before it in the release that the submission still holds (found by
    cell_key). The grade ids put back, in order. A test cell whose grade id was changed is still
    there (its cell id is): nbgrader refuses that submission, and autograde names it."""
    put_back = []
    for index, cell in enumerate(release.cells):
        held = {cell_key(kept): position for position, kept in enumerate(submission.cells)}
        renamed = cell.get("id") in {kept.get("id") for kept in submission.cells}
        if not is_test_cell(cell) or grade_id(cell) in held or renamed:
            continue
        before = next((held[cell_key(earlier)] for earlier in reversed(release.cells[:index])
                       if cell_key(earlier) in held), -1)
        submission.cells.insert(before + 1, cell.copy())
        put_back.append(grade_id(cell))
    return put_back


def restore_deleted_tests(root, lesson):
    """nbgrader restores a test cell a trainee edited, but scores one they deleted 0, however
    right the answer above it. So, in each submission of ``lesson`` not autograded yet, put the
    missing test cells back from the release (autograde then runs the tests nbgrader keeps,
    hidden ones included). {trainee: [grade ids put back]}. A submission that is not a notebook
    is left to autograde, which names it."""
    import nbformat

    release = nbformat.read(Path(root) / "release" / lesson / f"{lesson}.ipynb", as_version=4)
    restored = {}
    for path in sorted(Path(root).glob(f"submitted/*/{lesson}/{lesson}.ipynb")):
        trainee = path.parent.parent.name
        if (Path(root) / "autograded" / trainee / lesson).is_dir():
            continue
        try:
            submission = nbformat.read(path, as_version=4)
        except (ValueError, OSError):  # not JSON, or not a notebook: autograde names it
            continue
        if put_back := put_back_tests(release, submission):
            write_notebook(submission, path)
            restored[trainee] = put_back
    return restored


def write_notebook(notebook, path):
    """``notebook`` into ``path`` whole or not at all, with the mode the file had. The temporary
    file is a new one (mkstemp: O_EXCL), never a file or link of that name a trainee handed in."""
    import nbformat

    descriptor, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        nbformat.write(notebook, out)
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def generate(root):
    """Student versions of every lesson into root/release/<lesson>/, in one nbgrader run, without
    the working copies that running the lessons in the course root leaves there, and unpaired."""
    nbgrader(root, "generate_assignment", "*", "--force")
    release = Path(root) / "release"
    for working_copy in (path for name in WORKING_COPIES for path in release.glob(f"*/{name}")):
        working_copy.unlink()
    for notebook in release.glob("*/*.ipynb"):
        unpair(notebook)
    return release


def unpair(notebook):
    """Drop jupytext's pairing from a released notebook: opened next to its lesson's .py file, a
    paired notebook would take its cells, solutions and hidden tests included, from that file."""
    import nbformat

    released = nbformat.read(notebook, as_version=4)
    if released.metadata.pop("jupytext", None) is not None:
        write_notebook(released, notebook)  # nbgrader's 0644 kept: trainees read the release


def hand_in(folder, lesson, notebook):
    """A submission folder holding ``notebook`` (an nbformat notebook)."""
    import nbformat

    folder.mkdir(parents=True)
    nbformat.write(notebook, folder / f"{lesson}.ipynb")
    return folder


def keep_private(folder):
    """A trainee's work is personal data: readable by the instructor alone."""
    folder.chmod(0o700)
    for path in folder.rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)


def autograde(root, lesson, submissions):
    """Copy ``submissions`` ({student: folder with <lesson>.ipynb and any file handed in with it,
    such as a working copy}) of ``lesson`` into root/submitted/ and autograde every submission of
    the lesson there in one nbgrader run, as an instructor does: {student: {grade_id: (score,
    max)}} for the students given."""
    from nbgrader.api import Gradebook

    for student, handed_in in submissions.items():
        folder = Path(root) / "submitted" / student / lesson
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(handed_in, folder)
        keep_private(Path(root) / "submitted" / student)
    nbgrader(root, "autograde", lesson, "--force")
    with Gradebook(f"sqlite:///{Path(root).resolve()}/gradebook.db") as gradebook:
        return {student: {grade.name: (grade.score, grade.max_score) for grade in
                          gradebook.find_submission_notebook(lesson, lesson, student).grades}
                for student in submissions}


def gradebook_url(root):
    return f"sqlite:///{Path(root).resolve()}/gradebook.db"


def graded_cells(notebook_path):
    """(grade id, points) of each graded cell of a notebook, in the notebook's order."""
    import nbformat

    notebook = nbformat.read(notebook_path, as_version=4)
    return [(meta["grade_id"], meta.get("points", 0)) for meta in
            (cell.metadata.get("nbgrader", {}) for cell in notebook.cells) if meta.get("grade")]


def class_summary(root, lesson):
    """Who handed in ``lesson`` and what each scored, from the gradebook in ``root``:
    (exercises, rows): exercises are (grade id, points) in the released notebook's order; rows
    are (trainee, status, {grade id: score}) for every trainee of the gradebook (its roster:
    `nbgrader db student import`, and everyone autograded), where status is "on time",
    "late by H:MM:SS" (after the assignment's due date and any extension), "missing" (no
    submission), or "not graded" (handed in, but autograde failed: see its log)."""
    from datetime import timedelta

    from nbgrader.api import Gradebook, MissingEntry

    exercises = graded_cells(Path(root) / "release" / lesson / f"{lesson}.ipynb")
    rows = []
    with Gradebook(gradebook_url(root)) as gradebook:
        for student in sorted(gradebook.students, key=lambda student: student.id):
            handed_in = (Path(root) / "submitted" / student.id / lesson).is_dir()
            ungraded = (student.id, "not graded" if handed_in else "missing", {})
            if not (Path(root) / "autograded" / student.id / lesson).is_dir():
                rows.append(ungraded)
                continue
            try:
                submission = gradebook.find_submission(lesson, student.id)
            except MissingEntry:  # graded, then removed from the gradebook: autograde it again
                rows.append(ungraded)
                continue
            late = submission.total_seconds_late
            status = f"late by {timedelta(seconds=round(late))}" if late > 0 else "on time"
            rows.append((student.id, status, {grade.name: grade.score for notebook in
                                              submission.notebooks for grade in notebook.grades}))
    return exercises, rows


def exercise_means(exercises, rows):
    """{grade id: the class's mean fraction of its points}, over the graded submissions."""
    graded = [scores for _, _, scores in rows if scores]
    return {name: sum(scores.get(name, 0) for scores in graded) / (points * len(graded))
            for name, points in exercises if graded and points}


def summary_table(lesson, exercises, rows):
    """The class summary as text: a line per trainee, the mean per exercise, and the exercises to
    teach again (lowest mean first)."""
    means = exercise_means(exercises, rows)
    late = sum(status.startswith("late") for _, status, _ in rows)
    counts = {status: sum(row[1] == status for row in rows) for status in ("missing", "not graded")}
    lines = [f"{lesson}: {len(rows)} trainees, {sum(bool(s) for _, _, s in rows)} graded "
             f"({late} late), {counts['missing']} missing, {counts['not graded']} not graded",
             "exercises: " + ", ".join(f"{number} {name} ({points} points)" for number, (name, points)
                                       in enumerate(exercises, 1))]
    width = max([len("trainee"), *(len(name) for name, _, _ in rows)])
    numbers = "".join(f"{number:>6}" for number in range(1, len(exercises) + 1))
    lines.append(f"{'trainee':<{width}}  {'handed in':<16}{numbers}   total")
    total_points = sum(points for _, points in exercises)
    for name, status, scores in rows:
        cells = "".join(f"{scores[grade_id]:>6g}" if grade_id in scores else f"{'-':>6}"
                        for grade_id, _ in exercises)
        total = f"{sum(scores.values()):g}/{total_points}" if scores else "-"
        lines.append(f"{name:<{width}}  {status:<16}{cells}   {total}")
    lines.append(f"{'mean':<{width}}  {'':<16}" + "".join(
        f"{means[grade_id]:>6.0%}" if grade_id in means else f"{'-':>6}"
        for grade_id, _ in exercises))
    weakest = sorted(means.items(), key=lambda item: item[1])
    lines.append("teach again first: " + (", ".join(f"{name} ({mean:.0%})" for name, mean in
                                                    weakest if mean < 1) or "none"))
    return "\n".join(lines)


def plot_means(lesson, exercises, rows, path):
    """A bar for each exercise: the class's mean fraction of its points, into the PNG ``path``."""
    import matplotlib
    matplotlib.use("Agg")  # a file, on a login node without a display
    import matplotlib.pyplot as plt

    means = exercise_means(exercises, rows)
    names = [name for name, _ in exercises if name in means]
    figure, axes = plt.subplots(figsize=(7, 0.4 * len(names) + 1.2))
    axes.barh(names[::-1], [means[name] for name in names[::-1]])
    axes.set_xlim(0, 1)
    axes.set_xlabel("the class's mean share of the points")
    axes.set_title(f"{lesson}: {sum(bool(scores) for _, _, scores in rows)} graded submissions")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


@dataclass(frozen=True)
class Item:
    """What the class made of one graded cell (item analysis)."""
    grade_id: str
    points: float
    mean: float  # the class's mean share of its points
    at_zero: float  # the share of the graded trainees who scored 0 on it
    discrimination: float | None  # correlation with the rest of the total; None: either is flat
    error: tuple | None  # (the commonest error line of the failing submissions, how many)


def item_statistics(exercises, rows, errors):
    """An Item for each graded cell with points, over the graded submissions of ``rows``
    (class_summary), lowest mean first (in the notebook's order among equals). ``errors``: {grade
    id: the error line of each failing submission} (failing_errors). The discrimination is the
    correlation of the cell's score with the trainee's total without it: near 1, the cell
    separates those who learnt the lesson from those who did not; near 0 or below, it measures
    something else (a trick question, an unclear instruction)."""
    graded = [scores for _, _, scores in rows if scores]
    items = []
    for name, points in exercises:
        if not graded or not points:
            continue
        cell = [scores.get(name, 0) for scores in graded]
        rest = [sum(scores.values()) - score for scores, score in zip(graded, cell)]
        try:
            discrimination = statistics.correlation(cell, rest)
        except statistics.StatisticsError:  # fewer than 2 submissions, or one side all equal
            discrimination = None
        commonest = Counter(errors.get(name, [])).most_common(1)
        items.append(Item(name, points, sum(cell) / (points * len(graded)),
                          sum(score == 0 for score in cell) / len(graded), discrimination,
                          commonest[0] if commonest else None))
    return sorted(items, key=lambda item: item.mean)


def error_line(cell):
    """The first line of the error a cell's outputs end with ("NameError: name 'x' is not
    defined"), or None."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            text = f"{output.ename}: {output.evalue}" if output.evalue else output.ename
            return text.splitlines()[0][:160]
    return None


def failing_errors(root, lesson, exercises, rows):
    """{grade id: the error line of each graded submission that lost points on that cell}, read
    from the autograded notebooks."""
    import nbformat

    points, found = dict(exercises), defaultdict(list)
    for trainee, _, scores in rows:
        if not scores:
            continue
        graded = nbformat.read(Path(root) / "autograded" / trainee / lesson / f"{lesson}.ipynb",
                               as_version=4)
        for cell in graded.cells:
            name, line = grade_id(cell), error_line(cell)
            if name in points and scores.get(name, 0) < points[name] and line:
                found[name].append(line)
    return found


def items_table(lesson, items, graded):
    """The item analysis as text, lowest mean first."""
    width = max([len("cell"), *(len(item.grade_id) for item in items)])
    lines = [f"{lesson}: each graded cell over {graded} graded submissions, lowest mean first",
             f"{'cell':<{width}}  points   mean  at zero  discrimination  commonest error "
             "(submissions)"]
    for item in items:
        discrimination = "-" if item.discrimination is None else f"{item.discrimination:+.2f}"
        error = "-" if item.error is None else f"{item.error[0]} ({item.error[1]})"
        lines.append(f"{item.grade_id:<{width}}  {item.points:>6g}  {item.mean:>5.0%}  "
                     f"{item.at_zero:>7.0%}  {discrimination:>14}  {error}")
    return "\n".join(lines)
