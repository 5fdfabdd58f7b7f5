"""Nobody who can reach a job's rendezvous port runs code in it (issue 20, item 1).

The attack, tried on the kit's launch and, to show that it works, on the c10d rendezvous the
batch files used before: while two processes hold their group, another client connects to the
launcher's TCP store (no password is needed) and writes a crafted pickle, base64-encoded as the
c10d backend stores its state, under the keys the rendezvous would read. Unpickled, it creates a
file. The c10d launcher unpickles its state at every keep-alive (5 s): the file appears. The
static rendezvous the kit uses keeps no pickled state: the file never appears and the job ends
normally.
"""
import base64
import pickle
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from coursekit import KIT_ROOT, launch
from conftest import CreatesFile, kit_env

pytestmark = pytest.mark.stages
HOLD = KIT_ROOT / "tests" / "helpers" / "hold_group.py"
JOB_ID = "4242"  # what the old batch files used as the rendezvous id: public in squeue


def crafted_state(marker):
    return base64.b64encode(pickle.dumps(CreatesFile(marker))).decode()


def listening(port):
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def attack(job, port, marker):
    """Until the job ends: connect to its store and write the crafted state under the c10d
    rendezvous keys of every run id one could guess. Returns how many rounds it wrote."""
    deadline = time.monotonic() + 60
    while job.poll() is None and not listening(port):
        assert time.monotonic() < deadline, "the launcher never listened"
        time.sleep(0.2)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    rounds = 0
    while job.poll() is None and time.monotonic() < deadline:
        try:
            for run_id in (JOB_ID, "none", ""):
                store.set(f"torch.rendezvous.{run_id}", crafted_state(marker))
        except dist.DistError:  # the launcher went away (the pickle may have made it crash)
            break
        rounds += 1
        time.sleep(0.5)
    return rounds


def launched_and_attacked(command, port, tmp_path, hold_seconds):
    """Launch `command` with the helper holding its group; attack it: (rounds of writes, exit
    status, output, whether the crafted pickle ran)."""
    marker = tmp_path / "the-attackers-code-ran"
    job = subprocess.Popen([*map(str, command), str(HOLD), str(hold_seconds)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=kit_env(), cwd=tmp_path)
    try:
        rounds = attack(job, port, marker)
        output = job.communicate(timeout=60)[0]  # the store closes as the job ends: let it end
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return rounds, job.returncode, output, marker.exists()


def test_the_c10d_rendezvous_runs_a_pickle_written_to_its_store(tmp_path):
    """The control: the launch the batch files used until issue 20 (ids from the job id)."""
    port = launch.free_port()
    c10d = [*launch.torchrun(2)[:3], "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={JOB_ID}"]
    rounds, _, output, ran = launched_and_attacked(c10d, port, tmp_path, hold_seconds=8)
    assert rounds >= 1 and ran, output[-3000:]  # within one keep-alive (5 s) of the write


def test_the_kits_launch_runs_nothing_written_to_its_store(tmp_path):
    port = launch.free_port()
    rounds, status, output, ran = launched_and_attacked(launch.torchrun(2, master_port=port),
                                                        port, tmp_path, hold_seconds=4)
    # the pickle sat in the store for seconds while the job ran: nothing read it
    assert rounds >= 4 and not ran and status == 0, output[-3000:]


def test_batch_files_launch_torchrun_with_the_static_rendezvous_at_a_fresh_port():
    text = "\n".join(path.read_text() for path in (KIT_ROOT / "batchfiles").glob("*/batch-*.sh"))
    assert "torchrun" in text and "rdzv" not in text and "--standalone" not in text
    starts = [line for line in text.splitlines() if " torchrun " in f"{line} "]
    assert starts and all(f"{launch.PER_NODE_SHELL} torchrun" in line for line in starts)
    assert "MASTER_PORT=$(python -m coursekit free-port)" in text
    assert "SLURM_JOB_ID %" not in text  # no port another user can work out
