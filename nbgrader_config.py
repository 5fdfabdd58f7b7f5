"""nbgrader configuration: the lessons in notebooks/ are the source tree, one assignment per lesson.

    make assignments                        student versions of every lesson into release/
    nbgrader autograde 01-single-gpu-gpt    grade submitted/<student>/01-single-gpu-gpt/*.ipynb
    nbgrader formgrader (in JupyterLab)     manual grading and feedback
"""
import os
from pathlib import Path

from coursekit import course, grading

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

# Grades and trainees' work are personal data: what nbgrader writes here (gradebook.db,
# submitted/, autograded/, feedback/) is for the instructor's eyes alone. The release keeps
# nbgrader's own 644, so that trainees can read a copy of it.
os.umask(0o077)
c.Autograde.permissions = 400  # octal, as nbgrader reads it
c.GenerateFeedback.permissions = 600

c.CourseDirectory.source_directory = "notebooks"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
# The jupytext pair of a lesson holds its solutions: only the notebook is released.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "runs",
                            "[0-9][0-9]-*.py", "[0-9][0-9][a-z]-*.py"]  # 00-..., 00b-...
# A trainee's working copies of the stage scripts (lessons 02 and 04, practice) are theirs:
# autograde keeps the ones handed in, never the course root's own; `python -m coursekit
# assignments` releases none.
c.Autograde.exclude_overwriting = {lesson: list(grading.WORKING_COPIES)
                                   for lesson in grading.lessons(Path(__file__).parent)}
c.ExecutePreprocessor.timeout = 600
# Autograde runs trainees' code: in the kit's grading kernel, a bubblewrap sandbox where it sees
# no gradebook, no other submission and none of the grader's files, and writes only its own
# folder (coursekit/sandbox.py; it needs `bwrap`, from the bubblewrap package).
os.environ["JUPYTER_PATH"] = os.pathsep.join(
    [str(Path(grading.__file__).with_name("jupyter")), *filter(None, [os.environ.get("JUPYTER_PATH")])])
c.Execute.kernel_name = grading.GRADING_KERNEL
# the grading kernel's channels: Unix sockets in a folder of its own, as its sandbox has no network
c.Execute.kernel_manager_class = "coursekit.sandbox.SandboxKernelManager"
# A submission in the exchange that belongs to another user than the trainee it names is refused
# (nbgrader only warns): one trainee cannot hand in work as another.
c.ExchangeFactory.collect = grading.OwnerCheckedCollect
# ...and the feedback it releases can be read by the trainee it is for (its copy of a private file
# would be private too).
c.ExchangeFactory.release_feedback = grading.ReadableFeedbackRelease
# Autograde runs only what grading needs: cells tagged "demo" (training runs, launches, plots of
# runs) are not executed, and no graded cell may carry that tag (the kit's sanitising step).
c.Execute.skip_cells_with_tag = grading.DEMO_TAG
c.Autograde.sanitize_preprocessors = grading.sanitize_preprocessors()
# Student versions carry no instructor's note (cells tagged "instructor").
c.GenerateAssignment.preprocessors = grading.generate_preprocessors()
# Feedback, which trainees read, shows no hidden test.
c.GenerateFeedback.preprocessors = grading.feedback_preprocessors()
# The class's course id and exchange (release, fetch, submit, collect), from course.toml.
course.configure(c, Path(__file__).parent)
