"""The kernel that autograde runs a submission in: IPython inside a bubblewrap sandbox.

nbgrader's autograde executes every trainee's notebook, and so runs their code with the rights
of whoever grades. nbgrader_config.py therefore names this kernel (coursekit-grading, in
coursekit/jupyter/kernels/), whose command is

    python -m coursekit.sandbox -f CONNECTION_FILE [kernel options]

It starts the ordinary IPython kernel under bubblewrap (`bwrap`, unprivileged Linux namespaces)
in a view of the file system made only of what the kernel needs, where the submission:

- reads the system's programs and libraries, Python and its packages, and of the kit what
  trainees have (its code, data and models: no .git, tests, book, lesson sources, runs or
  nbgrader folders), all read-only;
- works in a copy of its own folder, autograded/<student>/<lesson>/, held in memory and gone
  when the kernel ends: nothing it writes or links there is left for autograde, which then
  writes the graded notebook and sets modes in that folder as the grader;
- sees nothing else of the course or of the grader's home (no gradebook, no other submission,
  no keys, tokens or shell history), and a private /tmp and home;
- has no network: it talks to autograde over Unix sockets in a folder of its own
  (SandboxKernelManager), not over TCP;
- gets none of the grader's environment variables but those a lesson needs, and none that
  looks like a secret.

Each cell has autograde's timeout (nbgrader_config.py).
"""
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from coursekit import KIT_ROOT, KitError

#: What the sandbox keeps of the environment: a lesson's settings, never something secret.
KEPT_VARIABLES = re.compile(r"(PATH|HOME|USER|LOGNAME|LANG|LC_\w+|TZ|TERM|VIRTUAL_ENV|PYTHON\w*|"
                            r"OMP_\w+|MKL_\w+|TIKTOKEN_\w+|TORCH_\w+|HF_\w+|CUDA_\w+|ROCR_\w+|"
                            r"HIP_\w+|JPY_\w+|JUPYTER_\w+|MPLBACKEND)")
SECRET_LOOKING = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
#: What of the kit a submission must not see: the history and the instructor's files, which
#: hold the lessons' solutions and hidden tests (feedback would carry whatever a cell prints back
#: to its trainee), nbgrader's folders of trainees' work, and the grader's own runs and builds.
HIDDEN_IN_KIT = {".git", "tests", "book", ".ci", "notebooks", "runs", "release", "submitted",
                 "autograded", "feedback", "_build", "trainee-kit", "gradebook.db",
                 "nbgrader_config.py", "course.toml"}
#: The system's folders the kernel reads (those that exist on this machine).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")


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


def bwrap_command(folder, connection_file, copied_files):
    """bubblewrap's command for grading the submission in ``folder``, up to the kernel's own;
    ``copied_files`` is {path in folder: an open file descriptor of its content}."""
    course_root(folder)  # refuses a folder that is not a submission being graded
    # Not --new-session: autograde interrupts a cell past its timeout by signalling the kernel's
    # process group, and the kernel has no terminal that a new session would keep it from.
    command = [bwrap(), "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
               "--unshare-net"]
    for system in SYSTEM:
        command += ["--ro-bind-try", system, system]
    command += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", str(Path.home())]
    for python in dict.fromkeys([Path(sys.prefix), Path(sys.base_prefix)]):
        command += ["--ro-bind", str(python), str(python)]
    for part in sorted(KIT_ROOT.iterdir()):
        if part.name not in HIDDEN_IN_KIT and Path(sys.prefix) != part:
            command += ["--ro-bind", str(part), str(part)]
    command += ["--tmpfs", str(folder)]  # the submission's copy, in memory
    for path, descriptor in copied_files.items():
        command += ["--dir", str(path.parent), "--file", str(descriptor), str(path)]
    command += ["--bind", str(connection_file.parent), str(connection_file.parent),
                "--chdir", str(folder), "--clearenv"]
    for name, value in kept_environment(os.environ).items():
        command += ["--setenv", name, value]
    return command


def open_copies(folder):
    """{path: an inheritable read descriptor} of every regular file under ``folder``, for the
    sandbox's copy of it; links (which a submission may have planted) are left out."""
    copies = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not any(p.is_symlink() for p in (path, *path.parents)):
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            os.set_inheritable(descriptor, True)
            copies[path] = descriptor
    return copies


class SandboxKernelManager(AsyncKernelManager):
    """The grading kernel's manager (nbgrader_config.py): the kernel's channels are Unix sockets
    in a new folder of its own (0700, short enough for a socket's path), which the sandbox binds;
    the folder goes with the kernel."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.own_folder = tempfile.mkdtemp(prefix="kit-grade-", dir="/tmp")
        self.transport = "ipc"
        self.connection_file = os.path.join(self.own_folder, "kernel.json")
        self.ip = os.path.join(self.own_folder, "kernel")

    def cleanup_resources(self, restart=False):
        super().cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self.own_folder, ignore_errors=True)


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
    folder = Path.cwd().resolve()
    command = bwrap_command(folder, connection_file, open_copies(folder))
    os.execv(command[0], [*command, "--", sys.executable, "-m", "ipykernel_launcher", *argv])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KitError as err:
        sys.exit(f"coursekit grading kernel: {err}")
