"""Shared fixtures: the kit's root, a freshly built builtin corpus, and a runner for stage scripts."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coursekit import KIT_ROOT, data


@pytest.fixture(scope="session")
def kit_root():
    return KIT_ROOT


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory):
    """The offline corpus, built once per test session exactly as `make book` builds it."""
    out = tmp_path_factory.mktemp("builtin")
    data.prepare_builtin(out, progress=False)
    return out


#: Screenshots the browser tests saved in this session, listed at the end of the test output.
SCREENSHOTS = []


def pytest_terminal_summary(terminalreporter):
    if SCREENSHOTS:
        terminalreporter.write_sep("-", "browser screenshots")
        for path in SCREENSHOTS:
            terminalreporter.write_line(str(path))


def pytest_addoption(parser):
    parser.addoption("--built-book", metavar="DIR", help="test this already built HTML book (for "
                     "example _build/html after `make book`) instead of building one cold")


@pytest.fixture(scope="session")
def built_book(tmp_path_factory, request):
    """The HTML book from a cold build (no execution cache) into a temporary folder, exactly as
    `make book` runs it; built once for the book and the browser tests."""
    if request.config.getoption("--built-book"):
        return Path(request.config.getoption("--built-book")).resolve()
    out = tmp_path_factory.mktemp("book")
    start = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build", str(KIT_ROOT),
                             "-W", "-n", "--keep-going", "--path-output", str(out)],
                            capture_output=True, text=True, timeout=1500)
    print(f"cold book build: {time.perf_counter() - start:.0f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return out / "_build" / "html"


def debian_tool(binary, *packages):
    """The path of ``binary``, installed from Debian's ``packages`` with apt-get when it is missing
    and we may (root in a Debian-like box); the test is skipped when neither works."""
    found = shutil.which(binary)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
        quiet = {"capture_output": True, "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
        if subprocess.run(install, **quiet).returncode != 0:
            # A fresh image has no package lists yet.
            subprocess.run(["apt-get", "update"], **quiet)
            subprocess.run(install, **quiet)
        found = shutil.which(binary)
    if found is None:
        pytest.skip(f"{binary} is not installed and could not be installed with apt-get")
    return found


def stage_command(script, *args):
    return [sys.executable, str(KIT_ROOT / "solutions" / script), *map(str, args)]


def run_stage(script, *args, timeout=600, env=None, **kwargs):
    """Run a stage script to completion; returns the CompletedProcess (text output)."""
    return subprocess.run(stage_command(script, *args), capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", KIT_ROOT), env=env or kit_env(),
                          **kwargs)


def kit_env(extra=None):
    env = dict(os.environ)
    env.setdefault("TIKTOKEN_CACHE_DIR", str(data.tiktoken_cache_dir()))
    return {**env, **(extra or {})}


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def srun_task_env(procid, ntasks, port):
    """The variables `srun` gives task `procid` of a one-node job, plus the rendezvous address the
    kit's batch files export; no torchrun variables."""
    slurm = {"SLURM_PROCID": procid, "SLURM_LOCALID": procid, "SLURM_NTASKS": ntasks,
             "SLURM_NTASKS_PER_NODE": ntasks, "SLURM_NODEID": 0, "SLURM_NNODES": 1,
             "SLURM_JOB_ID": 4242, "SLURM_JOB_NAME": "kit-test", "SLURM_NODELIST": "localhost",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": 1}
    env = kit_env({name: str(value) for name, value in slurm.items()})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return env


def run_as_srun_tasks(script, ntasks, *args, timeout=600):
    """Start a stage script once per task, as `srun python script ...` does; wait for all of them
    and return their CompletedProcess results in task order."""
    command, port = stage_command(script, *args), free_port()
    tasks = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=KIT_ROOT, env=srun_task_env(procid, ntasks, port))
             for procid in range(ntasks)]
    try:
        outputs = [task.communicate(timeout=timeout) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    return [subprocess.CompletedProcess(command, task.returncode, out, err)
            for task, (out, err) in zip(tasks, outputs)]
