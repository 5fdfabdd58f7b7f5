"""The ddp stage: DDP gradients equal single-process ones; 2 processes follow the std run and
resume after a pre-emption signal exactly where an uninterrupted run would be."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import kit_env, run_as_srun_tasks, run_stage
from coursekit import KIT_ROOT, runs
from test_stage_std import assert_identical, assert_same_run

pytestmark = pytest.mark.stages
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DDP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"
STEPS = ["--preset", "tiny", "--max-steps", "20", "--eval-interval", "10", "--sample-tokens", "0"]


def torchrun_command(nproc, script, *args):
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(script), *map(str, args)]


def torchrun(nproc, script, *args, check=True):
    result = subprocess.run(torchrun_command(nproc, script, *args), capture_output=True,
                            text=True, timeout=600, env=kit_env())
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_ddp_gradient_equals_the_single_process_gradient():
    result = torchrun(2, KIT_ROOT / "tests" / "helpers" / "ddp_gradient_check.py", DDP_SCRIPT)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2
    assert report["max_grad_diff"] <= 1e-6
    assert report["max_param_diff_across_ranks"] == 0.0


@pytest.fixture(scope="module")
def std_metrics(builtin_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("std20")
    result = run_stage("train_gpt2_std.py", *STEPS, "--data", builtin_data, "--out", out)
    assert result.returncode == 0, result.stderr
    return runs.read_metrics(out)


@pytest.fixture(scope="module")
def two_process_run(builtin_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp20")
    result = torchrun(2, DDP_SCRIPT, *STEPS, "--ckpt-interval", "10", "--data", builtin_data,
                      "--out", out)
    return out, result.stdout


def test_two_processes_follow_std_at_the_same_global_batch(two_process_run, std_metrics):
    out, stdout = two_process_run
    assert "2 processes, backends cpu:gloo" in stdout
    assert stdout.count("step 1/20 ") == 1  # only rank 0 prints
    config = runs.read_json(out / "config.json")
    assert (config["stage"], config["world_size"], config["grad_accum"]) == ("ddp", 2, 1)
    ddp_metrics = runs.read_metrics(out)
    assert [r["step"] for r in ddp_metrics] == list(range(1, 21))
    for ddp, std in zip(ddp_metrics, std_metrics, strict=True):
        assert ddp["loss"] == pytest.approx(std["loss"], abs=1e-4)
        assert ddp.get("val_loss", 0) == pytest.approx(std.get("val_loss", 0), abs=1e-4)
    assert runs.load_checkpoint(out)[0] == 20


def test_srun_python_tasks_train_like_torchrun(builtin_data, tmp_path, two_process_run):
    """`srun python train_gpt2_ddp.py`: no torchrun, the ranks come from SLURM_* variables."""
    reference, _ = two_process_run
    tasks = run_as_srun_tasks("train_gpt2_ddp.py", 2, *STEPS, "--ckpt-interval", "10",
                              "--data", builtin_data, "--out", tmp_path)
    assert [task.returncode for task in tasks] == [0, 0], tasks[0].stderr[-3000:]
    assert "2 processes, backends cpu:gloo" in tasks[0].stdout
    assert "step" not in tasks[1].stdout  # rank 1 is silent
    got, expected = runs.read_metrics(tmp_path), runs.read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-6)


def test_one_process_without_torchrun_is_the_std_run(builtin_data, tmp_path, std_metrics):
    result = run_stage("train_gpt2_ddp.py", *STEPS, "--data", builtin_data, "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "processes" not in result.stdout
    assert [r["loss"] for r in runs.read_metrics(tmp_path)] == \
           pytest.approx([r["loss"] for r in std_metrics], abs=1e-6)


def test_preempted_run_resumes_like_an_uninterrupted_one(builtin_data, tmp_path, two_process_run):
    """SIGUSR1 reaches the ranks at different moments (as Slurm's does); they agree on a step,
    rank 0 checkpoints, all exit 0; the resumed run ends bit for bit where the reference did."""
    reference, _ = two_process_run
    command = torchrun_command(2, DDP_SCRIPT, *STEPS, "--ckpt-interval", "10",
                               "--data", builtin_data, "--out", tmp_path)
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=kit_env())
    deadline = time.time() + 300
    while len(runs.read_metrics(tmp_path)) < 5:
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()
        time.sleep(0.1)
    for worker in psutil.Process(launcher.pid).children():
        worker.send_signal(signal.SIGUSR1)
        time.sleep(0.05)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, stderr[-3000:]
    stopped_at = runs.read_metrics(tmp_path)[-1]["step"]
    assert f"SIGUSR1 received: checkpoint saved at step {stopped_at}" in stdout
    assert stopped_at < 20 and runs.load_checkpoint(tmp_path)[0] == stopped_at

    resumed = torchrun(2, DDP_SCRIPT, *command[4:], "--resume")
    assert "resumed from" in resumed.stdout
    assert_same_run(runs.read_metrics(tmp_path), runs.read_metrics(reference))
    final, expected = runs.load_checkpoint(tmp_path), runs.load_checkpoint(reference)
    for part in ("model", "optimizer", "train_loader"):
        assert_identical(final[1][part], expected[1][part])


def test_batch_that_does_not_split_across_processes_is_refused(builtin_data, tmp_path):
    result = torchrun(2, DDP_SCRIPT, "--preset", "tiny", "--batch-tokens", "512",
                      "--data", builtin_data, "--out", tmp_path, check=False)
    assert result.returncode != 0
    assert "error: --batch-tokens 512 is not a multiple of B x T x processes" in result.stderr
