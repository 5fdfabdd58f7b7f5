"""Shared fixtures: the kit's root, a freshly built builtin corpus, and a runner for stage scripts.

And the suite's rule on skips: a test that does not run is not a pass. Only tests marked `gpu`
may skip (they skip where CUDA is absent). Any other skip, or a Debian tool that cannot be
installed, fails the run on CI (CI set) and whenever the tests run as root, where everything can
be installed and started. A developer running tests as non-root with CI unset may see such skips
(the Slurm cluster needs root); the run then passes, and its summary lists them under a banner.
"""
import base64
import contextlib
import fcntl
import getpass
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

# `make test` runs pytest-xdist workers on a 2-core machine (two, and one for the Slurm tests).
# PyTorch starts one thread per core in every process, so the workers' lessons and runs would keep
# many more busy threads than cores, which wait for each other: a pair of lessons took 136 s side
# by side that way and 106 s with one thread each (and a third less CPU time). So each worker, and
# every kernel, stage run and job it starts, uses one thread, as torchrun gives its processes; set
# before torch loads. Ray starts its workers at nice 15, below its own raylet, which suits a node
# whose cores are the job's. Here they share the cores with the other pytest worker's processes at
# nice 0, which then get 28 times their share: the Ray Train test took 50 s alone and 269 s beside
# a lesson, and a Ray cluster across the test cluster's nodes did not start in 300 s (39 s alone).
# So Ray's workers run at the same priority as everything else the tests start.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("RAY_worker_niceness", "0")

from coursekit import KIT_ROOT, data, launch
from coursekit.launch import free_port  # the tests take it from here
from helpers import forkserver


@pytest.fixture(scope="session")
def kit_root():
    return KIT_ROOT


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory):
    """The offline corpus, built once per test session exactly as `make book` builds it."""
    return made_once(tmp_path_factory, "builtin",
                     lambda out: data.prepare_builtin(out, progress=False))


#: Where the browser tests save screenshots; the ones of this session are listed at the end of
#: the test output (found on disk: under pytest-xdist, the tests run in other processes).
SCREENSHOT_DIR = KIT_ROOT / "_build" / "browser"
SESSION_START = time.time()

#: `make test` runs the suite on 3 pytest-xdist workers. The tests of these files stay on one
#: worker: the book is built from the lessons' nbval runs, and the browser tests share its two
#: editions (built_book, instructor_book), so the book's tests follow nbval on its worker instead
#: of waiting for it on another; the Slurm test cluster is one per machine (and its worker takes
#: nothing else: pytest_xdist_make_scheduler). Every other test file goes whole to whichever worker
#: is free, so that its module fixtures (a training run) run once.
WORKER_GROUPS = {"tests/test_notebooks.py": "book", "tests/test_book.py": "book",
                 "tests/test_browser.py": "book", "tests/test_slurm.py": "slurm"}


#: The longest files, longest first (as `pytest --durations=0` measured them on this 2-core
#: machine), so that the short ones fill in at the end and the workers finish together. The
#: lessons' nbval runs come before the book, which is built from them (built_book).
LONGEST_FIRST = ("tests/test_notebooks.py", "tests/test_slurm.py", "tests/test_book.py",
                 "tests/test_browser.py", "tests/test_grading.py", "tests/test_ray.py",
                 "tests/test_gpu_paths.py", "tests/test_stage_lora.py", "tests/test_tracking.py",
                 "tests/test_stage_tp.py", "tests/test_hpo.py", "tests/test_stage_std.py",
                 "tests/test_stage_resnet.py", "tests/test_site_torch.py", "tests/test_stage_pp.py",
                 "tests/test_faults.py", "tests/test_stage_ddp.py", "tests/test_class.py",
                 "tests/test_selftest.py", "tests/test_stage_fsdp.py", "tests/test_export_hf.py",
                 "tests/test_stage_lit.py", "tests/test_ondemand.py", "tests/test_launch.py")


@pytest.hookimpl(trylast=True)  # after pytest-random-order's shuffle (--random-order-seed=N):
def pytest_collection_modifyitems(items):  # the files run in this order, their tests shuffled
    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each file keeps its own order


def pytest_xdist_make_scheduler(config, log):
    # pytest-xdist's own --dist loadgroup cannot be used: it renames the tests' node ids, which
    # pytest 9 no longer takes, so its groups are silently ignored.
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return WORKER_GROUPS.get(nodeid.split("::")[0], super()._split_scope(nodeid))

        def _assign_work_unit(self, node):
            """With 3 workers or more, the last runs the Slurm group and nothing else: its tests
            mostly wait for jobs whose processes are Slurm's, not the worker's, so it would leave
            a core idle while they wait. The other workers never take the Slurm group. With
            fewer (xdist shuts down the workers that a few files leave without work), any worker
            takes any group."""
            if len(self.nodes) < 3:
                return super()._assign_work_unit(node)
            slurm_worker = node is self.nodes[-1] and any(
                self._split_scope(nodeid) == "slurm" for nodeid in self.collection)
            self.assigned_work.setdefault(node, {})
            for scope in self.workqueue:
                if (scope == "slurm") == slurm_worker:
                    self.workqueue.move_to_end(scope, last=False)
                    return super()._assign_work_unit(node)
            if slurm_worker:
                # Its group is all sent. A worker holds back its last test until it is told that
                # no more will come, which xdist says once every other file has gone out: the
                # last Slurm test (the dead node's, which waits out timeouts) started in ci36
                # after 16 idle minutes, and ran alone at the end of the session.
                node.shutdown()

    # in the order of collection (LONGEST_FIRST), not xdist's default of the most tests first
    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def strict_checks():
    """True on CI and as root: there every tool can be had, so a test that cannot run fails."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false") or os.geteuid() == 0


#: (test id, reason) of every test skipped in this session, with and without the gpu marker, and
#: of every expected failure (pytest's xfail; strict, so an unexpected pass fails).
GPU_SKIPS, OTHER_SKIPS, XFAILS = [], [], []
#: Why a gpu test may skip: no GPU at all, or fewer than it needs (the reason says how many).
GPU_SKIP_REASONS = re.compile(r"no CUDA device$|needs \d+ GPUs\b")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu"):
        import torch  # only here: most runs have no gpu test and need not pay for the import

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")


def pytest_runtest_logreport(report):
    # Under pytest-xdist the main process gets every worker's reports here, with their markers
    # among the keywords.
    if hasattr(report, "wasxfail"):  # an expected failure is no skip, but it is counted
        if report.skipped:
            XFAILS.append((report.nodeid, report.wasxfail))
    elif report.skipped:
        reason = skip_reason(report)
        allowed = "gpu" in report.keywords and GPU_SKIP_REASONS.match(reason)
        (GPU_SKIPS if allowed else OTHER_SKIPS).append((report.nodeid, reason))


def pytest_collectreport(report):
    # A module skipped while it is imported: its markers are unknown, so it counts as a non-gpu
    # skip (gpu tests skip through their marker, above).
    if report.skipped:
        OTHER_SKIPS.append((report.nodeid, skip_reason(report)))


def skip_reason(report):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_sessionfinish(session):
    for server in FORK_SERVERS:
        server.stop()
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: to the main process
        session.config.workeroutput["fork_server"] = [server.counts() for server in FORK_SERVERS]
    # pytest exits with session.exitstatus as it stands after this hook.
    passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if OTHER_SKIPS and strict_checks() and session.exitstatus in passing:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_testnodedown(node, error):
    WORKERS_FORK_SERVERS.extend(node.workeroutput.get("fork_server", []))


WORKERS_FORK_SERVERS = []


def pytest_terminal_summary(terminalreporter, config):
    report_screenshots(terminalreporter)
    report_fork_servers(terminalreporter)
    if not config.option.collectonly:  # nothing ran, nothing skipped
        report_skips(terminalreporter)


def report_screenshots(terminalreporter):
    saved = sorted(path for path in SCREENSHOT_DIR.glob("*.png")
                   if path.stat().st_mtime >= SESSION_START)
    if saved:
        terminalreporter.write_sep("-", "browser screenshots")
        for path in saved:
            terminalreporter.write_line(str(path))


def report_fork_servers(terminalreporter):
    """How many runs the fork servers forked, and why the others were started as processes."""
    counts = WORKERS_FORK_SERVERS or [server.counts() for server in FORK_SERVERS]
    forked = sum(count.get("forked", 0) for count in counts)
    refused = {}
    for count in counts:
        for reason, number in count.get("refused", {}).items():
            refused[reason] = refused.get(reason, 0) + number
    if forked or refused:
        terminalreporter.write_line(f"fork server: {forked} runs forked, "
                                    f"{sum(refused.values())} refused: {refused}")


def report_skips(terminalreporter):
    """The number of skips and expected failures, always; the skips other than a gpu test's for
    want of GPUs under a banner."""
    count = (f"{len(GPU_SKIPS) + len(OTHER_SKIPS)} skipped "
             f"({len(GPU_SKIPS)} marked gpu, {len(OTHER_SKIPS)} not), {len(XFAILS)} xfailed")
    if not OTHER_SKIPS:
        terminalreporter.write_sep("=", count, green=True)
        return
    verdict = ("which fails this run (CI or root)" if strict_checks() else
               "allowed only because this run is not CI and not root; CI fails on them")
    terminalreporter.write_sep("!", f"{count}: only gpu tests may skip, for want of GPUs, "
                                    f"{verdict}", red=True, bold=True)
    for nodeid, reason in OTHER_SKIPS:
        terminalreporter.write_line(f"SKIPPED {nodeid}: {reason}", red=True)


def pytest_addoption(parser):
    parser.addoption("--built-book", metavar="DIR", help="test this already built HTML book (for "
                     "example _build/html after `make book`) instead of building one")


def session_folder(tmp_path_factory, name):
    """A folder of this test session that every pytest-xdist worker sees."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def one_ray_at_a_time(tmp_path_factory):
    """Hold the session's Ray turn, shared by every pytest-xdist worker, for as long as a Ray
    cluster lives (a local Ray, a lesson's, a Slurm job's). A raylet has a fixed 30 s to register
    with its node, and on 2 cores two Ray clusters starting at once miss it: a Slurm job's Ray
    cluster beside the local Ray tests' trials did not start within 300 s (ci48, and a CI run),
    and the local head missed it three times beside lesson 05 and the Slurm self-test (ci47).
    It keeps Ray from Ray only: in ci49, alone in its turn but beside lessons 04 and 05 and the
    Slurm jobs, the local head missed it five times in a row."""
    lock = os.open(session_folder(tmp_path_factory, "ray-turn"), os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # and with it the lock


def ray_turn_for(lesson, tmp_path_factory):
    """The Ray turn (one_ray_at_a_time) for a lesson that starts a local Ray when it runs; none
    for the others."""
    starts_ray = "raycluster.connect()" in lesson_notebook(lesson).with_suffix(".py").read_text()
    return one_ray_at_a_time(tmp_path_factory) if starts_ray else contextlib.nullcontext()


class LessonExecutions:
    """nbval's executions of the lessons (tests/nbval_record.py), kept in a jupyter-cache store
    that the books are built from: each lesson executes once for both. Shared by the workers in a
    folder of the session: whichever test asks first for a lesson (its nbval test, the book, the
    record's test) runs nbval on it, under the folder's lock; the others, in any order, read
    what it kept."""

    def __init__(self, folder, tmp_path_factory):
        self.folder = folder
        self.cache = folder / "cache"
        self.tmp_path_factory = tmp_path_factory

    def executed(self, lesson):
        """The record of nbval's run of ``lesson``, run now if no test ran it yet; fails naming
        the lesson if that run failed (the test that ran it shows why)."""
        # the Ray turn before the lessons' lock, never inside it: holding that lock while Ray
        # tests hold the turn would keep every other lesson waiting
        with ray_turn_for(lesson, self.tmp_path_factory):
            return self.executed_in_turn(lesson)

    def executed_in_turn(self, lesson):
        lock = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.outcome(lesson) is None:
                self.run_and_keep(lesson)
        finally:
            os.close(lock)
        if self.outcome(lesson) != "kept":
            pytest.fail(f"nbval failed on {lesson}; the test that ran it first shows nbval's "
                        "output", pytrace=False)
        return self.folder / f"{lesson}.ipynb"

    def outcome(self, lesson):
        return next((end for end in ("kept", "failed")
                     if (self.folder / f"{lesson}.{end}").exists()), None)

    def run_and_keep(self, lesson):
        """nbval's run of ``lesson``, recorded; the record kept for the books if it passes."""
        from coursekit import book
        record, notebook = self.folder / f"{lesson}.ipynb", lesson_notebook(lesson)
        try:
            run_nbval(lesson, record)
            book.keep_execution(nbformat.read(record, as_version=4), notebook, self.cache)
            (self.folder / f"{lesson}.kept").touch()
        except BaseException:
            (self.folder / f"{lesson}.failed").touch()
            raise


def lesson_notebook(lesson):
    return KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb"


def run_nbval(lesson, record):
    """nbval's run of a lesson in its folder, recorded to ``record`` (nbval_record.py): its
    cells in their order, whatever options this session's pytest took (a random order's seed)."""
    env = {**{name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"},
           "PYTHONPATH": os.pathsep.join(
               filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q",
                             "-p", "no:cacheprovider", "-p", "no:random_order",
                             "-p", "nbval_record",
                             "--record-executed", str(record), str(lesson_notebook(lesson))],
                            capture_output=True, text=True, cwd=lesson_notebook(lesson).parent,
                            env=env, timeout=900)
    print(f"nbval {lesson}: {time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def made_once(tmp_path_factory, name, make):
    """The folder ``name`` of this test session, made by ``make(folder)`` once for every
    pytest-xdist worker: by the first that asks, while the others wait on its lock. Tests only
    read it."""
    base = session_folder(tmp_path_factory, name)
    folder, made = base / name, base / "made"
    lock = os.open(base, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():  # not yet, or the worker that tried failed: from scratch
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    finally:
        os.close(lock)  # and with it the lock
    return folder


@pytest.fixture
def own_compile_caches(tmp_path, monkeypatch):
    """A HOME of the test's own; the compile caches and the temporary folder that a compiling
    stage's parse_args points this process at (coursekit.caches) are put back after the test,
    so that no later test of the worker inherits them. Returns the HOME."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # none named: the stage chooses, and monkeypatch restores
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    return tmp_path


@pytest.fixture(scope="session")
def lesson_executions(tmp_path_factory):
    return LessonExecutions(session_folder(tmp_path_factory, "lesson-executions"),
                            tmp_path_factory)


def lessons_run_under_nbval(session):
    """The lessons whose nbval test this session runs (tests/test_notebooks.py)."""
    test = "tests/test_notebooks.py::test_lesson_runs_under_nbval["
    return [item.nodeid.removeprefix(test)[:-1] for item in session.items
            if item.nodeid.startswith(test)]


@pytest.fixture(scope="session")
def built_book(lesson_executions, tmp_path_factory, request):
    """The reader's edition of the book, built once for the book and the browser tests with `make
    book`'s code, from nbval's executions of the lessons when this session runs nbval (whether
    their tests ran yet or not: lesson_executions), and from executions of its own otherwise."""
    if request.config.getoption("--built-book"):
        return Path(request.config.getoption("--built-book")).resolve()
    from coursekit import book
    for lesson in lessons_run_under_nbval(request.session):
        lesson_executions.executed(lesson)
    start = time.perf_counter()
    html = book.build("reader", KIT_ROOT, out=tmp_path_factory.mktemp("reader"),
                      cache_dir=lesson_executions.cache)
    print(f"book build: {time.perf_counter() - start:.0f} s")
    return html


@pytest.fixture(scope="session")
def instructor_book(lesson_executions, built_book, tmp_path_factory):
    """The instructor's edition, from the executions the reader's edition used."""
    from coursekit import book
    return book.build("instructor", KIT_ROOT, out=tmp_path_factory.mktemp("instructor"),
                      cache_dir=lesson_executions.cache)


def debian_tool(binary, *packages):
    """The path of ``binary``, installed from Debian's ``packages`` with apt-get when it is missing
    and we may (root in a Debian-like box). When neither works the test fails on CI and as root,
    so that a broken mirror or a renamed package cannot pass as a skip; elsewhere it is skipped."""
    if not shutil.which(binary):
        log = (apt_install(packages) if os.geteuid() == 0 and shutil.which("apt-get") else
               "(not tried: installing needs root and apt-get)")
        if not shutil.which(binary):
            message = (f"{binary} is not installed, and apt-get install {' '.join(packages)} "
                       f"did not provide it:\n{log}")
            if strict_checks():
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
    return shutil.which(binary)


def apt_install(packages):
    """Install Debian packages; returns what apt-get said, for the message when it fails."""
    # another developer's apt-get may hold the lock for a while: wait for it rather than fail
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
    install = [*apt, "install", "-y", "--no-install-recommends", *packages]
    quiet = {"capture_output": True, "text": True,
             "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
    # The workers install their tools one at a time: apt-get update fails at once, whatever
    # the timeout, while another worker's holds the package lists (apt 2.6).
    with open("/run/lock/coursekit-apt-get.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = [subprocess.run(install, **quiet)]
        if runs[-1].returncode != 0:
            # A fresh image has no package lists yet.
            runs += [subprocess.run([*apt, "update"], **quiet), subprocess.run(install, **quiet)]
    return "\n".join(f"$ {' '.join(done.args)}  (exit {done.returncode})\n"
                     f"{(done.stdout + done.stderr)[-3000:]}" for done in runs)


def stage_command(script, *args):
    return [sys.executable, str(KIT_ROOT / "solutions" / script), *map(str, args)]


def run_stage(script, *args, timeout=600, env=None, cwd=KIT_ROOT, server=None, **popen):
    """Run a stage script to completion; returns the CompletedProcess (text output)."""
    return run_python(stage_command(script, *args), env or kit_env(), cwd, timeout, server,
                      **popen)


def run_python(command, env, cwd=KIT_ROOT, timeout=600, server=None, **popen):
    """subprocess.run(command, capture_output=True, text=True) for a command that runs a Python
    script: forked from the fork server, which has torch and the kit imported already
    (tests/helpers/forkserver.py), or a process of its own where the server refuses the run or
    where subprocess options (``popen``: a preexec_fn's limits, say) must apply. ``server``: a
    fork server of the caller's instead of FORK_SERVER."""
    result = None if popen else (server or FORK_SERVER).run(command, env, cwd, timeout)
    return result or subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                    cwd=cwd, env=env, **popen)


def kit_env(extra=None):
    env = dict(os.environ)
    env.setdefault("TIKTOKEN_CACHE_DIR", str(data.tiktoken_cache_dir()))
    return {**env, **(extra or {})}


#: This worker's fork server, started by its first run, stopped at the end of the session.
FORK_SERVER = forkserver.Server(kit_env)
#: The lora stage's: what its runs import beyond the other stages' as well (Accelerate, PEFT,
#: Transformers with its GPT-2). A server of its own, so that the others never pay for it. Not
#: DeepSpeed, which Accelerate imports to unwrap a model: its import starts a thread (jemalloc's,
#: through pyarrow), and a fork of a process with threads may copy a lock that one of them held.
LORA_FORK_SERVER = forkserver.Server(kit_env, preloaded=(
    *forkserver.PRELOADED, "accelerate", "peft", "transformers",
    "transformers.models.gpt2.modeling_gpt2"))
FORK_SERVERS = (FORK_SERVER, LORA_FORK_SERVER)


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


# --- Runs that several stage test files read --------------------------------------------------
# Each is trained once per session and only read afterwards; a test that has to change a run
# copies it first. They pass --device cpu: 2 processes share the CPU even where one GPU is
# present, and the CPU is what they test. A validation of 2 batches (the preset's is 8) is what
# a comparison between runs needs: the tests compare runs with each other, not with a target.
# For the same reason a step is a quarter of the preset's (samples of 32 tokens, 256 tokens a
# step: 2 micro-batches of 4 on one process, 1 each on 2, micro-batch 2 on 4): the logits over the
# 50,304-token vocabulary are most of a tiny step's work, so a 20-step run takes 7 CPU-seconds
# instead of 15, and the splits across processes the tests make stay whole.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # as torchrun sets it
QUARTER_STEP = ["--seq-len", "32", "--batch-tokens", "256"]
TWENTY_STEPS = ["--preset", "tiny", "--max-steps", "20", "--eval-interval", "10",
                "--eval-steps", "2", "--ckpt-interval", "10", "--sample-tokens", "0",
                "--device", "cpu", *QUARTER_STEP]
TEN_STEPS = ["--preset", "tiny", "--max-steps", "10", "--eval-interval", "5", "--eval-steps", "2",
             "--ckpt-interval", "5", "--sample-tokens", "0", "--device", "cpu", *QUARTER_STEP]


def torchrun_command(nproc, script, *args, restarts=0):
    """The kit's own launch (coursekit.launch): torchrun's static rendezvous at a free port."""
    return [*launch.torchrun(nproc, restarts=restarts), str(script), *map(str, args)]


def torchrun(nproc, script, *args, check=True, restarts=0, env=None, server=None):
    """torchrun's run of ``script`` on ``nproc`` processes. A run without restarts is a group
    forked from the fork server with the variables torchrun gives its workers
    (torchrun_worker_env), whose failed rank gets the others killed and the status 1, as under
    torchrun; tests of what torchrun itself does on a restart or a signal start the real
    torchrun, as the Slurm tests and the lessons always do. ``server``: a fork server of the
    caller's instead of FORK_SERVER."""
    env = env or kit_env()
    result = None
    if restarts == 0:
        result = forked_torchrun(nproc, [sys.executable, str(script), *map(str, args)], env,
                                 server=server or FORK_SERVER)
    if result is None:
        result = launched_torchrun(nproc, script, args, restarts, env)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def launched_torchrun(nproc, script, args, restarts, env, attempts=3):
    """The real torchrun's run, started again at another port should another process take the
    one chosen (free_port) before the launcher's store binds it: a collision, never what a test
    tests (the batch files' ports are their job's)."""
    for _ in range(attempts):
        result = subprocess.run(torchrun_command(nproc, script, *args, restarts=restarts),
                                capture_output=True, text=True, timeout=600, env=env)
        if "EADDRINUSE" not in result.stderr:
            return result
    return result


def forked_torchrun(nproc, command, env, attempts=3, server=FORK_SERVER):
    """The group of forked workers, or None if the server refuses them. The port that rank 0's
    store binds was free when chosen; should another process take it first, the group starts
    again at another (as the kit's batch files do not need to: their port is the job's)."""
    for _ in range(attempts):
        port = free_port()
        envs = [torchrun_worker_env(env, rank, nproc, port) for rank in range(nproc)]
        result = server.group([command] * nproc, envs, os.getcwd(), 600)
        if result is None or "EADDRINUSE" not in result.stderr:
            return result
    return result


def torchrun_worker_env(env, rank, nproc, port):
    """What torchrun's static rendezvous gives each worker on one node (torch 2.13,
    torch/distributed/elastic/agent/server/local_elastic_agent.py), except that rank 0 holds the
    store, as under `srun python`, since no agent holds it."""
    threads = {} if nproc == 1 else {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    given = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
             "ROLE_NAME": "default", "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc,
             "GROUP_WORLD_SIZE": 1, "ROLE_WORLD_SIZE": nproc, "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
             "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "none",
             "TORCHELASTIC_USE_AGENT_STORE": False, "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1}
    return {**env, **threads, **{name: str(value) for name, value in given.items()}}


def expected_backend():
    """What a ddp/fsdp/tp process group uses here: NCCL beside gloo where torch sees a GPU."""
    import torch
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


@pytest.fixture(scope="session")
def std_twenty_steps(builtin_data, tmp_path_factory):
    """The std stage's 20-step run in one thread (two such runs agree bit for bit): the reference
    of std's resume tests and of ddp and lit at the same global batch. Its run directory."""
    def train(out):
        result = run_stage("train_gpt2_std.py", *TWENTY_STEPS, "--data", builtin_data, "--out",
                           out, env=kit_env(ONE_THREAD))
        assert result.returncode == 0, result.stderr[-3000:]
        out.with_suffix(".stdout").write_text(result.stdout)
    return made_once(tmp_path_factory, "std20", train)


def std_stdout(run_dir):
    """What the std_twenty_steps run printed."""
    return run_dir.with_suffix(".stdout").read_text()


def held_pythonpath():
    """PYTHONPATH with tests/slurm/hold first: with KIT_HOLD_AT_STEP=K, every Python process that
    prints the line of step K waits there until a stop signal reaches it."""
    return os.pathsep.join(filter(None, [str(KIT_ROOT / "tests" / "slurm" / "hold"),
                                         os.environ.get("PYTHONPATH")]))


def made_in_kit(tmp_path_factory, target):
    """`make target` in the kit, by one pytest-xdist worker at a time: the first that finds it
    missing or stale makes it, while the others wait on the lock, then find it made."""
    lock = os.open(session_folder(tmp_path_factory, "make-in-kit"), os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["make", target], cwd=KIT_ROOT, check=True, capture_output=True,
                       timeout=900)
    finally:
        os.close(lock)  # and with it the lock


@pytest.fixture(scope="session")
def base_run(tmp_path_factory):
    """The std stage's full tiny run as `make book` trains it (300 steps, the pretrained model of
    lesson 05): made by `make` before the tests and the lessons (the Makefile's BASE_MODEL), here
    too if it is missing. Its run directory, runs/base-tiny; tests only read it."""
    made_in_kit(tmp_path_factory, "models/kit-tiny/config.json")
    return KIT_ROOT / "runs" / "base-tiny"


@pytest.fixture(scope="session")
def ddp_ten_steps(builtin_data, tmp_path_factory):
    """10 steps of the ddp stage on 2 processes: what fsdp, tp and pp must train like, and a ddp
    run to export. Its run directory."""
    return stage_run_once(tmp_path_factory, "ddp10", "ddp", *TEN_STEPS, "--data", builtin_data)[0]


@pytest.fixture(scope="session")
def fsdp_ten_steps(builtin_data, tmp_path_factory):
    """10 steps of the fsdp stage on 2 processes, checkpoints at 5 and 10: (run directory,
    stdout)."""
    return stage_run_once(tmp_path_factory, "fsdp10", "fsdp", *TEN_STEPS, "--data", builtin_data)


@pytest.fixture(scope="session")
def tp_ten_steps(builtin_data, tmp_path_factory):
    """10 steps of the tp stage on 2 processes (dp=1 x tp=2), checkpoints at 5 and 10: (run
    directory, stdout). Read by the tp stage's tests and exported by export-hf's."""
    return stage_run_once(tmp_path_factory, "tp10", "tp", *TEN_STEPS, "--tp", 2,
                          "--data", builtin_data)


@pytest.fixture(scope="session")
def pp_ten_steps(builtin_data, tmp_path_factory):
    """10 steps of a 2-stage pipeline (schedule 1F1B) ending with an 8-token sample,
    checkpoints at 5 and 10: (run directory, stdout). Read by the pp stage's tests and exported
    by export-hf's."""
    return stage_run_once(tmp_path_factory, "pp10", "pp", *TEN_STEPS, "--schedule", "1f1b",
                          "--sample-tokens", 8, "--data", builtin_data)


def stage_run_once(tmp_path_factory, name, stage, *args):
    """A run of the stage on 2 processes, made once for every worker: (run directory, stdout)."""
    def train(out):
        result = torchrun(2, KIT_ROOT / "solutions" / f"train_gpt2_{stage}.py", *args,
                          "--out", out)
        out.with_suffix(".stdout").write_text(result.stdout)
    out = made_once(tmp_path_factory, name, train)
    return out, out.with_suffix(".stdout").read_text()


class CreatesFile:
    """The attacks' payload: unpickling it calls open(path, "w"), and any code could run the same
    way. A test that writes it where the kit might unpickle it checks that the file never
    appears."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


# --- The kit's MLflow server (coursekit/mlflow_server.py) ---------------------------------------
#: `python -m coursekit ARGS` whose first choice of a free port (launch.free_port) is PORT, which
#: the test holds: as if another user of the node had bound it before the kit's server could
FIRST_PORT_TAKEN = """
import sys
from coursekit import cli, launch
choose = launch.free_port
choices = iter([int(sys.argv[1])])
launch.free_port = lambda: next(choices, None) or choose()
raise SystemExit(cli.main(sys.argv[2:]))
"""


def coursekit_with_first_port_taken(port, *args):
    return [sys.executable, "-c", FIRST_PORT_TAKEN, str(port), *map(str, args)]


def mlflow_server_command(state, *args):
    return [sys.executable, "-m", "coursekit", "mlflow-server", "--state", str(state),
            *map(str, args)]


#: The line the kit's MLflow server prints once it listens, with the port
MLFLOW_REPORTED = re.compile(r"^MLflow server of \S+ on \S+:(\d+) \(127\.0\.0\.1 only\)", re.M)


def mlflow_reported_port(log, written, server, timeout=120):
    """The port in the server's "MLflow server of ... on host:port" line, printed once it listens,
    after the first ``written`` bytes of ``log``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "mlflow server exited: " + log.read_text()[-3000:]
        with open(log, "rb") as output:
            output.seek(written)
            found = MLFLOW_REPORTED.search(output.read().decode(errors="replace"))
        if found:
            return int(found[1])
        time.sleep(0.5)
    raise AssertionError(f"the server reported no port within {timeout} s")


def owner_login(state):
    """(user name, password) of the kit's MLflow server that keeps its state in ``state``."""
    return getpass.getuser(), (Path(state) / "password").read_text().strip()


def http_get(url, login=None, headers=None):
    """(status, body) of GET ``url``, sent with HTTP basic ``login`` (user, password) if given."""
    headers = dict(headers or {})
    if login:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(login).encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, b""


@pytest.fixture(scope="session")
def kit_embedder(base_run, tmp_path_factory):
    """Lesson 09's dense embedder, as `make` trains it (the Makefile's EMBED_MODEL), here too if it
    is missing or older than the documents; its directory. Tests only read it."""
    made_in_kit(tmp_path_factory, "models/kit-embed/modules.json")
    return KIT_ROOT / "models" / "kit-embed"


class Cotenant:
    """A second Unix user of this machine, as on a shared node: issue 47's attacks run as them."""

    def __init__(self, name):
        self.name = name
        self.uid = pwd.getpwnam(name).pw_uid

    def run(self, *command, check=True):
        """``command`` (no Python: the kit's interpreter lives in root's closed home) as this user,
        in /tmp; the CompletedProcess."""
        result = subprocess.run(["runuser", "-u", self.name, "--", *command], cwd="/tmp",
                                capture_output=True, text=True, timeout=60)
        assert not check or result.returncode == 0, result.stderr
        return result


@pytest.fixture(scope="session")
def cotenant():
    """A user made with useradd for this session (one per pytest-xdist worker), removed after."""
    if os.geteuid() != 0:
        pytest.skip("a second Unix user is made with useradd, which needs root")
    name = f"kit-cotenant-{os.environ.get('PYTEST_XDIST_WORKER', 'gw')}"
    subprocess.run(["userdel", name], capture_output=True)  # left by a run that was killed
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    yield Cotenant(name)
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    subprocess.run(["userdel", name], capture_output=True)
