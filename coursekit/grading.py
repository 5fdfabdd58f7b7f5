"""nbgrader for the lessons: every folder in notebooks/ is an assignment, its notebook the source.

The course root holds nbgrader_config.py; `generate` writes student versions to release/,
`autograde` grades submitted notebooks and returns their per-cell scores from the gradebook.

Autograde runs only what grading needs. Cells tagged ``demo`` (training runs, launches, plots of
runs: what a lesson shows but no exercise needs) are not executed when grading; nbval and the
book still run them. `GradedCellsRun` keeps a submission from tagging a graded cell away.

What autograde runs is trainees' code: it runs in the grading kernel, a sandbox that sees no
gradebook, no other submission and none of the grader's files (coursekit/sandbox.py).
`OwnerCheckedCollect` refuses a submission handed in under another trainee's name.
"""
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

from nbgrader.exchange.default import ExchangeCollect
from nbgrader.preprocessors import NbGraderPreprocessor

from coursekit import KitError, diffs, stages
from coursekit.diffs import WORKING_COPIES

#: The cell tag that autograde skips (nbgrader_config.py sets it as Execute.skip_cells_with_tag).
DEMO_TAG = "demo"
#: The kernel autograde runs submissions in (coursekit/jupyter/kernels/, coursekit/sandbox.py).
GRADING_KERNEL = "coursekit-grading"
#: Lessons that grade the working copies (coursekit.diffs) handed in with the notebook: {lesson:
#: that exercise's id}. A release has no working copy: each trainee starts their own.
GRADED_WORKING_COPIES = {"02-ddp": "conversion", "04-model-parallelism": "conversions"}


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
    not collected, the others are, and the command fails naming it (nbgrader_config.py).
    (``fail`` logs the message and raises nbgrader's ExchangeError.)"""

    def copy_files(self):
        forged = {record["filename"]: owner for record in self.src_records
                  if (owner := owner_name(Path(self.inbound_path) / record["filename"]))
                  != record["username"]}
        self.src_records = [record for record in self.src_records
                            if record["filename"] not in forged]
        super().copy_files()
        if forged:
            self.fail("not collected, as each names a trainee who does not own it: " +
                      ", ".join(f"{name} (owned by {owner})" for name, owner in forged.items()))


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


def nbgrader(root, *args):
    """Run an nbgrader command in the course root; a failure is a KitError with nbgrader's log."""
    # nbgrader runs the `alembic` command of its own environment to create the gradebook
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=root, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"nbgrader {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


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
        tmp = notebook.with_name(f".{notebook.name}.tmp")
        nbformat.write(released, tmp)
        shutil.copymode(notebook, tmp)  # nbgrader's 0644: trainees read the release
        tmp.replace(notebook)


def hand_in(folder, lesson, notebook, converted):
    """A submission folder: ``notebook`` (an nbformat notebook) and, for a lesson that grades
    them, its working copies, converted to their target stages or as the lesson starts them."""
    import nbformat

    folder.mkdir(parents=True)
    nbformat.write(notebook, folder / f"{lesson}.ipynb")
    for step in diffs.lesson_steps(lesson) if lesson in GRADED_WORKING_COPIES else []:
        shutil.copy(stages.script_path(step.target if converted else step.source),
                    folder / diffs.working_copy_name(step))
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
