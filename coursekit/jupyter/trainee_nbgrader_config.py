"""nbgrader for trainees: where to fetch the lessons and hand them in (course.toml, which your
instructor sets). In the kit's folder, or in JupyterLab's Assignments tab:

    nbgrader fetch_assignment 01-single-gpu-gpt    the lesson, into 01-single-gpu-gpt/
    nbgrader submit 01-single-gpu-gpt              hand it in
    nbgrader fetch_feedback 01-single-gpu-gpt      your feedback, once it is released
"""
import os
from pathlib import Path

from coursekit import course

# What you fetch and write is yours alone (nbgrader gives the copy you hand in its own modes).
os.umask(0o077)
course.configure(get_config(), Path(__file__).parent)  # noqa: F821 (nbgrader provides it)
