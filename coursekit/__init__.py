"""coursekit: the tooling that no lesson changes.

Stage scripts in ``solutions/`` import it for what no lesson teaches: the preset table, data
preparation, run directories, performance arithmetic, their command line and run banner
(``training``) and their distributed set-up (``distributed``). The model (``solutions/gpt.py``),
data iteration, optimiser, training loop and parallelism live in ``solutions/`` because they are
what the lessons teach.
"""
from pathlib import Path

__version__ = "0.1.0"

#: The kit's checkout (where data/, runs/ and .cache/ live by default).
KIT_ROOT = Path(__file__).resolve().parent.parent


class KitError(Exception):
    """A problem the user can fix; shown as one line, never as a traceback."""
