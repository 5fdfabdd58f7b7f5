"""The kernel that autograde runs a submission in: IPython inside a bubblewrap sandbox.

nbgrader's autograde executes every trainee's notebook, and so runs their code with the rights
of whoever grades. nbgrader_config.py therefore names this kernel (coursekit-grading, in
coursekit/jupyter/kernels/), whose command is

    python -m coursekit.sandbox -f CONNECTION_FILE [kernel options]

It starts the ordinary IPython kernel under bubblewrap (`bwrap`, unprivileged Linux namespaces)
in a view of the file system where the submission:

- reads the machine, the kit and its data, and writes nothing of them (all read-only);
- writes only its own folder, autograded/<student>/<lesson>/, and a private /tmp and home;
- sees no gradebook (gradebook.db is an empty file to it), no other submission or feedback
  (submitted/, autograded/ and feedback/ are empty but for its own folder), no lesson source
  (solutions and hidden tests), and of the grader's home only the kit, the course and Python
  (no keys, tokens or shell history);
- gets none of the grader's environment variables but those a lesson needs, and none that
  looks like a secret.

The kernel still talks to autograde over 127.0.0.1, so it shares the network; each cell has
autograde's timeout (nbgrader_config.py).
"""
import os
import re
import shutil
import sys
from pathlib import Path

from coursekit import KIT_ROOT, KitError

#: What the sandbox keeps of the environment: a lesson's settings, never something secret.
KEPT_VARIABLES = re.compile(r"(PATH|HOME|USER|LOGNAME|LANG|LC_\w+|TZ|TERM|VIRTUAL_ENV|PYTHON\w*|"
                            r"OMP_\w+|MKL_\w+|TIKTOKEN_\w+|TORCH_\w+|HF_\w+|CUDA_\w+|ROCR_\w+|"
                            r"HIP_\w+|JPY_\w+|JUPYTER_\w+|MPLBACKEND)")
SECRET_LOOKING = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
#: What a submission must not see in the course root: trainees' work (nbgrader's folders,
#: nbgrader_config.py), the lessons' sources with their solutions and hidden tests (feedback would
#: carry whatever a cell prints back to its trainee), and the grader's own runs.
HIDDEN_FOLDERS = ("submitted", "autograded", "feedback", "notebooks", "runs")


def course_root(folder):
    """The course root of a submission being graded in root/autograded/<student>/<lesson>/."""
    root = folder.parents[2] if len(folder.parents) > 2 else None
    if root is None or folder.parents[1].name != "autograded" or \
            not (root / "nbgrader_config.py").is_file():
        raise KitError(f"the grading kernel runs in a course's autograded/<student>/<lesson>/ "
                       f"folder, not in {folder}")
    return root


def kept_environment(environment):
    """The variables the kernel gets. In its own PID namespace its parent is bubblewrap's init,
    PID 1, which ipykernel does not watch (it would take autograde's PID, which it cannot see,
    for a parent gone, and stop): --die-with-parent ends it with autograde instead."""
    kept = {name: value for name, value in environment.items()
            if KEPT_VARIABLES.fullmatch(name) and not SECRET_LOOKING.search(name)}
    return {**kept, "JPY_PARENT_PID": "1"}


def bwrap_command(folder, connection_file):
    """bubblewrap's command for grading the submission in ``folder``, up to the kernel's own."""
    root = course_root(folder)
    # Not --new-session: autograde interrupts a cell past its timeout by signalling the kernel's
    # process group, and the kernel has no terminal that a new session would keep it from.
    command = [bwrap(), "--die-with-parent", "--unshare-pid", "--unshare-ipc",
               "--unshare-uts", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/tmp", "--tmpfs", str(Path.home())]
    # what may live in the grader's home, read-only: the kit, the course, Python and its packages
    for needed in dict.fromkeys([KIT_ROOT, root, Path(sys.prefix), Path(sys.base_prefix)]):
        command += ["--ro-bind", str(needed), str(needed)]
    for hidden in dict.fromkeys(base / name for base in (root, KIT_ROOT) for name in HIDDEN_FOLDERS):
        if hidden.is_dir():
            command += ["--tmpfs", str(hidden)]
    if (root / "gradebook.db").exists():
        command += ["--ro-bind", "/dev/null", str(root / "gradebook.db")]
    command += ["--bind", str(folder), str(folder),
                "--ro-bind", str(connection_file), str(connection_file),
                "--chdir", str(folder), "--clearenv"]
    for name, value in kept_environment(os.environ).items():
        command += ["--setenv", name, value]
    return command


def bwrap():
    found = shutil.which("bwrap")
    if found is None:
        raise KitError("autograde runs each submission in a bubblewrap sandbox, and `bwrap` is "
                       "not installed: apt install bubblewrap, or dnf install bubblewrap")
    return found


def main(argv):
    """Replace this process with the IPython kernel, sandboxed; ``argv`` is the kernel's own
    (-f CONNECTION_FILE and options)."""
    connection_file = Path(argv[argv.index("-f") + 1]).resolve()
    command = bwrap_command(Path.cwd().resolve(), connection_file)
    os.execv(command[0], [*command, "--", sys.executable, "-m", "ipykernel_launcher", *argv])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KitError as err:
        sys.exit(f"coursekit grading kernel: {err}")
