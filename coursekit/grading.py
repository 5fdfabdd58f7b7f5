"""nbgrader for the lessons: every folder in notebooks/ is an assignment, its notebook the source.

The course root holds nbgrader_config.py; `generate` writes student versions to release/,
`autograde` grades a submitted notebook and returns its per-cell scores from the gradebook.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from coursekit import KitError


def lessons(root):
    """Lesson folders (assignment names) that have a notebook, in order."""
    return sorted(p.name for p in (Path(root) / "notebooks").iterdir()
                  if p.is_dir() and (p / f"{p.name}.ipynb").exists())


def nbgrader(root, *args):
    """Run an nbgrader command in the course root; a failure is a KitError with nbgrader's log."""
    # nbgrader runs the `alembic` command of its own environment to create the gradebook
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=root, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"nbgrader {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def generate(root, names=None):
    """Student versions of the lessons into root/release/<lesson>/."""
    for name in names or lessons(root):
        nbgrader(root, "generate_assignment", name, "--force")
    return Path(root) / "release"


def autograde(root, lesson, student, notebook):
    """Grade ``notebook`` as ``student``'s submission of ``lesson``: {grade_id: (score, max)}."""
    from nbgrader.api import Gradebook

    submission = Path(root) / "submitted" / student / lesson
    submission.mkdir(parents=True, exist_ok=True)
    shutil.copy(notebook, submission / f"{lesson}.ipynb")
    nbgrader(root, "autograde", lesson, "--student", student, "--force")
    with Gradebook(f"sqlite:///{Path(root).resolve()}/gradebook.db") as gradebook:
        graded = gradebook.find_submission_notebook(lesson, lesson, student)
        return {grade.name: (grade.score, grade.max_score) for grade in graded.grades}
