"""Nobody who can reach a job's rendezvous port runs code in it (issue 20, item 1; issue 47,
item 1).

The attack, tried on the kit's launch and, to show that it works, on the c10d rendezvous the
batch files used before and on torchrun's standalone mode the README showed: once two processes
hold their group (the rendezvous is complete), another client finds the launcher's TCP store as
`ss` would, connects (no password is needed), lists its keys and writes a crafted pickle,
base64-encoded as the c10d backend stores its state, under the keys the rendezvous would read.
Unpickled, it creates a file. A TCP connection carries no Unix user: run as root here, it is what
a co-tenant sends. Then the processes leave, and the launcher ends its rendezvous. A c10d
launcher reads its state back as it closes its rendezvous (and at every keep-alive before): the
file appears, whatever the machine's load, since every step waits for the one before. The static
rendezvous the kit uses keeps no pickled state: the file never appears and the job ends
normally.
"""
import base64
import pickle
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from coursekit import KIT_ROOT, launch
from conftest import CreatesFile, kit_env

pytestmark = pytest.mark.stages
HOLD = KIT_ROOT / "tests" / "helpers" / "hold_group.py"
JOB_ID = "4242"  # what the old batch files used as the rendezvous id: public in squeue


def crafted_state(marker):
    return base64.b64encode(pickle.dumps(CreatesFile(marker))).decode()


def store_port(job, deadline):
    """The port the launcher's store listens on, found as another user of the node finds it
    (`ss -ltn`: the job's new listening socket); the job's first listener is its store."""
    launcher = psutil.Process(job.pid)
    while job.poll() is None:
        assert time.monotonic() < deadline, "the launcher never listened"
        ports = [c.laddr.port for c in launcher.net_connections("tcp") if c.status == "LISTEN"]
        if ports:
            return ports[0]
        time.sleep(0.2)
    raise AssertionError("the launcher ended before it listened")


def rendezvous_keys(store):
    """The keys under which a c10d rendezvous would read its state: the store lists its keys to
    anyone, so a random id hides nothing; the job id is guessed besides."""
    listed = [key for key in store.list_keys() if key.startswith("torch.rendezvous.")]
    ids = {key.split(".")[2].split("/")[0] for key in listed} | {JOB_ID, "none", ""}
    return [f"torch.rendezvous.{run_id}" for run_id in ids]


def attack(job, marker, release):
    """Once the job's processes hold their group: connect to its store and write the crafted
    state under the c10d rendezvous keys of every run id listed or guessed; then create
    ``release``, and the processes leave. Until the job has ended, write it again every 0.5 s.
    Returns how many rounds it wrote."""
    deadline = time.monotonic() + 120
    port = store_port(job, deadline)
    while not Path(f"{release}.held").exists():
        assert job.poll() is None and time.monotonic() < deadline, "the group never formed"
        time.sleep(0.1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    rounds = 0
    while job.poll() is None and time.monotonic() < deadline:
        try:
            for key in rendezvous_keys(store):
                store.set(key, crafted_state(marker))
        except dist.DistError:  # the launcher went away (the pickle may have made it crash)
            break
        rounds += 1
        release.touch()
        time.sleep(0.5)
    release.touch()
    return rounds


def launched_and_attacked(command, tmp_path):
    """Launch `command` with the helper holding its group, and attack it: (rounds of writes,
    exit status, output, whether the crafted pickle ran)."""
    tmp_path.mkdir(exist_ok=True)
    marker, release = tmp_path / "the-attackers-code-ran", tmp_path / "release"
    job = subprocess.Popen([*map(str, command), str(HOLD), str(release)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=kit_env(), cwd=tmp_path)
    try:
        rounds = attack(job, marker, release)
        output = job.communicate(timeout=60)[0]  # the store closes as the job ends: let it end
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return rounds, job.returncode, output, marker.exists()


def attack_succeeds(launch_command, tmp_path, tries=3):
    """The controls: launch (``launch_command()``, a new port each time) and attack, until the
    crafted pickle runs, at most ``tries`` times; the last (rounds, output, ran). One success
    shows the attack works. A miss happened twice in full runs under load, in 2 to 3 rounds, the
    store gone when the next round came; its cause is not known. One possible cause, for c10d:
    when another process bound the chosen port first, torchrun's c10d backend joins that
    process's store as a client, and the attack on the launcher's own listener misses."""
    for attempt in range(tries):
        rounds, _, output, ran = launched_and_attacked(launch_command(), tmp_path / str(attempt))
        if ran:
            break
    return rounds, output, ran


def test_the_c10d_rendezvous_runs_a_pickle_written_to_its_store(tmp_path):
    """The control: the launch the batch files used until issue 20 (ids from the job id)."""
    rounds, output, ran = attack_succeeds(lambda: [
        *launch.torchrun(2)[:3], "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{launch.free_port()}", f"--rdzv-id={JOB_ID}"], tmp_path)
    assert rounds >= 1 and ran, output[-3000:]


def test_torchruns_standalone_mode_runs_a_pickle_written_to_its_store(tmp_path):
    """The launch the README taught until issue 47: a random id and port, found all the same."""
    rounds, output, ran = attack_succeeds(
        lambda: [*launch.torchrun(2)[:3], "--standalone", "--nproc-per-node=2"], tmp_path)
    assert rounds >= 1 and ran, output[-3000:]


def test_the_kits_launch_runs_nothing_written_to_its_store(tmp_path):
    """`python -m coursekit torchrun`, which the README and the stages' docstrings show."""
    kits = [sys.executable, "-m", "coursekit", "torchrun", "--nproc", "2"]
    rounds, status, output, ran = launched_and_attacked(kits, tmp_path)
    # the pickle sat in the store while the group held and as the launch ended: nothing read it
    assert rounds >= 1 and not ran and status == 0, output[-3000:]
    assert "$ " in output and "--master-port=" in output  # the command, shown


#: What starts a pickling rendezvous: no text the kit ships may contain it (this file runs it,
#: as the attack's control, and the lessons and the book name it in words).
PICKLING_LAUNCHES = re.compile(r"--standalone|rdzv[-_]backend")


def test_no_text_the_kit_ships_launches_a_pickling_rendezvous():
    tracked = subprocess.run(["git", "ls-files"], cwd=KIT_ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    offending = []
    for name in tracked:
        path = KIT_ROOT / name
        if name == "tests/test_launch.py" or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # images, not text
            continue
        offending += [f"{name}:{number}" for number, line in enumerate(text.splitlines(), 1)
                      if PICKLING_LAUNCHES.search(line)]
    assert not offending, offending


def test_batch_files_launch_torchrun_with_the_static_rendezvous_at_a_fresh_port():
    text = "\n".join(path.read_text() for path in (KIT_ROOT / "batchfiles").glob("*/batch-*.sh"))
    assert "torch.distributed.run" in text and "rdzv" not in text and "--standalone" not in text
    starts = [line for line in text.splitlines()
              if " torchrun " in f"{line} " or "torch.distributed.run" in line]
    assert starts and all(f"{launch.PER_NODE_SHELL} python -m torch.distributed.run" in line
                          for line in starts)
    assert "MASTER_PORT=$(python -m coursekit free-port)" in text
    assert "SLURM_JOB_ID %" not in text  # no port another user can work out


#: What a co-tenant writes over the addresses the processes leave for each other in the store
GARBAGE = b"\xff" * 64
#: The lines of a traceback that C++'s errors on such bytes end in, as gloo raises them
RAW_FAILURE = re.compile(r"^(ValueError: basic_string|MemoryError: std::bad_alloc|RuntimeError: "
                         r"\[enforce fail)", re.MULTILINE)


def test_garbage_in_the_start_up_keys_stops_the_launch_in_one_line_without_a_restart(
        builtin_data, tmp_path):
    """Issue 47, item 11: the store takes no password, so another user can break a job's start;
    what the processes read from it stops them with one line that says so, and the launch does
    not start the group again into the same store. The attacker overwrites every key of the
    launch's groups (launch_<attempt>/...) as soon as it is listed, until the job ends."""
    command = [*launch.torchrun(2, restarts=1), str(KIT_ROOT / "solutions" / "train_gpt2_ddp.py"),
               "--preset", "tiny", "--max-steps", "2", "--sample-tokens", "0", "--device", "cpu",
               "--data", str(builtin_data), "--out", str(tmp_path / "run")]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=kit_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        store = dist.TCPStore("127.0.0.1", store_port(job, deadline), is_master=False,
                              timeout=timedelta(seconds=10), wait_for_workers=False)
        overwritten = set()
        while job.poll() is None and time.monotonic() < deadline:
            try:
                for key in store.list_keys():
                    if key.startswith("launch_"):
                        store.set(key, GARBAGE)
                        overwritten.add(key)
            except dist.DistError:  # the launcher went away
                break
            time.sleep(0.005)
        output = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0 and overwritten, output[-3000:]
    assert re.search(r"^error: rank \d could not start its process group from what it read in "
                     r"the launch's store at 127\.0\.0\.1:\d+ \(", output, re.MULTILINE), output
    assert not RAW_FAILURE.search(output), output[-3000:]
    # the second attempt stopped at once, with the first one's line
    assert "error: not restarted, as a restart cannot mend it: rank" in output, output[-3000:]
    assert "step 1/2" not in output
