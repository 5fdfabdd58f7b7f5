"""The suite's own rules (conftest.py): only gpu tests may skip, a missing Debian tool fails on CI,
and `make test-fast` selects no test that trains, starts servers or installs packages.

Each rule is checked by running pytest in a subprocess, with the kit's conftest.py and pytest
settings, on a small test file written for the case.
"""
import os
import re
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT

PLAIN_SKIP = "def test_skips():\n    pytest.skip('no reason to run')\n"
GPU_SKIP = "@pytest.mark.gpu\ndef test_skips_on_gpu():\n    pytest.skip('no CUDA device')\n"
GPU_SKIP_FEW = "@pytest.mark.gpu\ndef test_skips_on_one_gpu():\n    pytest.skip('needs 2 GPUs; 1 here')\n"
GPU_SKIP_OTHER = ("@pytest.mark.gpu\n@pytest.mark.skip(reason='flaky')\n"  # before the GPU check
                  "def test_skips_for_its_own_reason():\n    pass\n")
XFAIL = "@pytest.mark.xfail(reason='a known bug')\ndef test_fails():\n    assert False\n"
XPASS = "@pytest.mark.xfail(reason='a known bug')\ndef test_passes_after_all():\n    assert True\n"
MODULE_SKIP = "pytest.importorskip('kit_no_such_module')\n"
PASSES = "def test_passes():\n    assert True\n"


def run_pytest(folder, tests, env=None):
    """pytest on a test file made of `tests`, in `folder` with a copy of the kit's conftest.py (and
    the helpers it imports) and with the kit's pytest settings; returns the CompletedProcess."""
    (folder / "conftest.py").write_text((KIT_ROOT / "tests" / "conftest.py").read_text())
    (folder / "helpers").symlink_to(KIT_ROOT / "tests" / "helpers")
    (folder / "test_sample.py").write_text("import pytest\n\n" + "\n\n".join(tests))
    # no CI variable from this run: each case says whether it is CI
    env = {**{name: value for name, value in os.environ.items() if name != "CI"}, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(KIT_ROOT / "pyproject.toml"), "--rootdir",
         str(folder), "-p", "no:cacheprovider", "-p", "no:nbval",  # nbval: 3 s of imports
         str(folder / "test_sample.py")],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.unit
@pytest.mark.parametrize("tests, returncode, count", [
    ([PLAIN_SKIP, PASSES], 1, "1 skipped (0 marked gpu, 1 not), 0 xfailed"),
    ([MODULE_SKIP, PASSES], 1, "1 skipped (0 marked gpu, 1 not), 0 xfailed"),
    ([GPU_SKIP, PASSES], 0, "1 skipped (1 marked gpu, 0 not), 0 xfailed"),
    ([GPU_SKIP_FEW, PASSES], 0, "1 skipped (1 marked gpu, 0 not), 0 xfailed"),
    ([GPU_SKIP_OTHER, PASSES], 1, "1 skipped (0 marked gpu, 1 not), 0 xfailed"),
    ([XFAIL, PASSES], 0, "0 skipped (0 marked gpu, 0 not), 1 xfailed"),
    ([XPASS, PASSES], 1, "0 skipped (0 marked gpu, 0 not), 0 xfailed"),
    ([PASSES], 0, "0 skipped (0 marked gpu, 0 not), 0 xfailed"),
], ids=["plain-skip", "module-skip", "gpu-skip", "gpu-skip-too-few", "gpu-skip-other-reason",
        "xfail", "xpass-is-strict", "no-skip"])
def test_on_ci_only_gpu_tests_may_skip_for_want_of_gpus(tmp_path, tests, returncode, count):
    run = run_pytest(tmp_path, tests, env={"CI": "true"})
    assert run.returncode == returncode, run.stdout[-3000:] + run.stderr[-2000:]
    assert count in run.stdout, run.stdout[-3000:]


# The euid the conftest reads, in the subprocess only; as root it cannot otherwise be a developer
# who is not root (setuid to nobody cannot reach a venv whose Python lives under /root).
NOT_ROOT = "import os\nos.geteuid = lambda: 65534\n"


@pytest.mark.unit
def test_a_developer_who_is_not_root_sees_skips_under_a_banner(tmp_path):
    run = run_pytest(tmp_path, [NOT_ROOT, PLAIN_SKIP, PASSES])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    banner = [line for line in run.stdout.splitlines() if "1 skipped (0 marked gpu, 1 not)" in line]
    assert banner and "CI fails on them" in banner[0], run.stdout[-3000:]
    assert "SKIPPED test_sample.py::test_skips: no reason to run" in run.stdout


MISSING_TOOL = """
from conftest import debian_tool

def test_needs_a_tool():
    debian_tool("kit-no-such-tool", "kit-no-such-package")
"""


@pytest.mark.unit
def test_on_ci_a_tool_apt_get_cannot_install_fails_the_test(tmp_path):
    # apt-get as a broken mirror would answer, so that nothing is installed for real
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'E: Unable to locate package' >&2\nexit 100\n")
    fake.chmod(0o755)
    run = run_pytest(tmp_path, [MISSING_TOOL],
                     env={"CI": "true", "PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:]
    assert "kit-no-such-tool is not installed" in run.stdout
    # as root, apt-get was tried, and its answer is in the failure
    assert ("E: Unable to locate package" in run.stdout) == (os.geteuid() == 0), run.stdout[-3000:]


HEAVY_MARKERS = "stages or slurm or browser or book or grading or notebooks or ondemand or slow"


def make_test_fast_selection():
    """The -m expression `make test-fast` runs pytest with."""
    makefile = (KIT_ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-fast:.*\n\t.*pytest -m \"([^\"]+)\"", makefile, re.M)
    assert recipe, "no `pytest -m` in the Makefile's test-fast recipe"
    return recipe.group(1)


@pytest.mark.slow
def test_make_test_fast_selects_no_heavy_test():
    """None of the tests `make test-fast` selects may be marked for work that trains, builds,
    starts servers or installs packages, or as slow ("left out of make test-fast")."""
    selection = f"({make_test_fast_selection()}) and ({HEAVY_MARKERS})"
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "-m", selection],
                         cwd=KIT_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, run.stdout[-3000:] + run.stderr
