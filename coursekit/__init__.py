"""coursekit: the tooling that no lesson changes.

Stage scripts in ``solutions/`` import it only for the preset table, data preparation, run
directories and performance arithmetic; the model, data iteration, training loop and parallelism
live in the scripts because they are what the lessons teach.
"""
from pathlib import Path

__version__ = "0.1.0"

#: The kit's checkout (where data/, runs/ and .cache/ live by default).
KIT_ROOT = Path(__file__).resolve().parent.parent


class KitError(Exception):
    """A problem the user can fix; shown as one line, never as a traceback."""
