"""What each fault costs a run, and whether anything is lost: the faults of tests/test_faults.py,
caused the same way (tests/helpers/fault/sitecustomize.py makes one process hang or die at a known
step), each timed against the same run with no fault, on this machine.

    crash    rank 1 of a 2-process ddp run is killed after step 7 (checkpoint: step 5); torchrun
             starts the group again (--max-restarts 1) and it resumes
    hang     rank 1 stops after step 3; rank 0 gives up after KIT_DIST_TIMEOUT; the run is
             started again with --resume
    disk     the std stage's first checkpoint (step 10) finds no room (each file 1 MB at most);
             the run is started again with room and --resume
    lease    an HPO worker is killed (SIGKILL) during its trial; another worker queues the trial
             again once its heartbeat is older than --lease, and resumes it

For each: recovery (the run's wall time minus the fault-free run's), the steps trained twice,
and whether the final model, optimiser and data position equal the fault-free run's bit for bit.
A node that dies and a tracking server that goes away need the kit's Slurm test cluster and an
MLflow server: tests/test_slurm.py and tests/test_tracking.py time them. Writes
benchmarks/results/faults.json.

    .venv/bin/python benchmarks/faults.py
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from throughput import machine

from coursekit import KIT_ROOT, data, launch, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "faults.json"
FAULT_HOOK = KIT_ROOT / "tests" / "helpers" / "fault"
DDP = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"
STD = KIT_ROOT / "solutions" / "train_gpt2_std.py"
TEN = ["--preset", "tiny", "--max-steps", "10", "--eval-interval", "5", "--eval-steps", "2",
       "--ckpt-interval", "5", "--sample-tokens", "0", "--device", "cpu"]
TWENTY = ["--preset", "tiny", "--max-steps", "20", "--eval-interval", "10", "--eval-steps", "2",
          "--ckpt-interval", "10", "--sample-tokens", "0", "--device", "cpu"]


def environment(fault=None, launches=1, **more):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **more}
    if fault:
        env.update(PYTHONPATH=str(FAULT_HOOK), KIT_FAULT=fault, KIT_FAULT_LAUNCHES=str(launches))
    return env


def timed(command, env, **popen):
    """(seconds, CompletedProcess) of a command run from the kit's root."""
    start = time.perf_counter()
    result = subprocess.run(list(map(str, command)), cwd=KIT_ROOT, env=env, capture_output=True,
                            text=True, **popen)
    return time.perf_counter() - start, result


def identical(run, reference):
    """Do two runs end with the same model, optimiser and data position, bit for bit?"""
    (_, got), (_, expected) = runs.load_checkpoint(run), runs.load_checkpoint(reference)
    return all(same(got[part], expected[part]) for part in ("model", "optimizer", "train_loader"))


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def crash(folder, corpus):
    reference, run = folder / "crash-reference", folder / "crash"
    args = [*TEN, "--data", corpus, "--resume"]
    clean, _ = timed([*launch.torchrun(2), DDP, *args, "--out", reference], environment())
    faulty, result = timed([*launch.torchrun(2, restarts=1), DDP, *args, "--out", run],
                           environment("dies 1 7"))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"fault": "crash", "recovery_s": faulty - clean, "steps_lost": 7 - 5,
            "identical": identical(run, reference)}


def hang(folder, corpus, timeout=5):
    reference, run = folder / "hang-reference", folder / "hang"
    args = [*TEN, "--data", corpus, "--resume"]
    clean, _ = timed([*launch.torchrun(2), DDP, *args, "--out", reference], environment())
    hung = subprocess.Popen(list(map(str, [*launch.torchrun(2), DDP, *args, "--out", run])),
                            cwd=KIT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=environment("hangs 1 3", KIT_DIST_TIMEOUT=str(timeout)))
    for line in hung.stdout:  # rank 1 hangs once step 3 is done
        if line.startswith("step 3/10 "):
            break
    start = time.perf_counter()
    for line in hung.stdout:  # rank 0's one line, once the timeout has passed
        if line.startswith("error: "):
            break
    stopped = time.perf_counter() - start
    subprocess.run(["pkill", "-9", "-f", str(run)])  # the hung rank and its launcher
    hung.wait()
    again, result = timed([*launch.torchrun(2), DDP, *args, "--out", run], environment())
    assert result.returncode == 0, result.stderr[-3000:]
    return {"fault": "hang", "recovery_s": stopped + again - clean, "others_stopped_after_s":
            stopped, "timeout_s": timeout, "steps_lost": 3, "identical": identical(run, reference)}


def disk(folder, corpus):
    reference, run = folder / "disk-reference", folder / "disk"
    args = [*TWENTY, "--data", corpus, "--resume"]
    clean, _ = timed([sys.executable, STD, *args, "--out", reference], environment())

    def one_megabyte_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, 2 ** 20))

    full, stopped = timed([sys.executable, STD, *args, "--out", run], environment(),
                          preexec_fn=one_megabyte_files)
    assert stopped.returncode == 1 and "no room to write checkpoint" in stopped.stderr
    again, result = timed([sys.executable, STD, *args, "--out", run], environment())
    assert result.returncode == 0, result.stderr[-3000:]
    return {"fault": "disk", "recovery_s": full + again - clean, "steps_lost": 10,
            "message": stopped.stderr.strip(), "identical": identical(run, reference)}


def lease(folder, corpus, lease_s=4):
    study = folder / "study"
    command = [sys.executable, KIT_ROOT / "solutions" / "hpo_optuna.py", "--data", corpus,
               "--study-dir", study, "--trials", "1", "--max-steps", "20", "--eval-interval",
               "10", "--pruner", "none", "--lease", lease_s, "--train-args",
               "--eval-steps 2 --ckpt-interval 2"]
    worker = subprocess.Popen(list(map(str, command)), cwd=KIT_ROOT, env=environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while runs.latest_checkpoint(study / "trials" / "0000") is None:
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    trainer = ["pgrep", "-f", str(study / "trials")]
    while subprocess.run(trainer, capture_output=True).returncode == 0:
        time.sleep(0.05)  # its trainer checkpoints and exits
    steps_done = runs.read_metrics(study / "trials" / "0000")[-1]["step"]
    time.sleep(lease_s / 2 + 0.1)  # another worker comes by once the heartbeat is late
    _, result = timed(command, environment())
    assert result.returncode == 0, result.stdout[-3000:]
    requeued_after = float(result.stdout.split("no heartbeat for ")[1].split(" s)")[0])
    log = (study / "trials" / "0000" / "train.log").read_text()
    resumed_from = int(log.split("resumed from ")[1].split(" at step ")[1].split()[0])
    return {"fault": "lease", "lease_s": lease_s, "recovery_s": requeued_after,
            "steps_lost": steps_done - resumed_from, "identical": None}


def main():
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        corpus = folder / "builtin"
        data.prepare_builtin(corpus, progress=False)
        results = [crash(folder, corpus), hang(folder, corpus), disk(folder, corpus),
                   lease(folder, corpus)]
    report = {"machine": machine(), "faults": results}
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for row in results:
        print(f"{row['fault']:6} recovery {row['recovery_s']:6.1f} s | steps lost "
              f"{row['steps_lost']:3} | identical {row['identical']}")
    shutil.rmtree(KIT_ROOT / "runs" / "hpo-tiny", ignore_errors=True)


if __name__ == "__main__":
    main()
