"""The ddp stage: its own training step on 2 processes computes the std stage's gradients and
update for the same global batch; 2 processes follow the std run and resume after a pre-emption
signal exactly where an uninterrupted run would be. `srun python train_gpt2_ddp.py` (ranks from
Slurm's variables, no torchrun) runs under the test cluster's real srun (tests/test_slurm.py)."""
import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import (ONE_THREAD, TWENTY_STEPS, expected_backend, kit_env, run_stage, torchrun,
                      torchrun_command)
from coursekit import KIT_ROOT, runs
from helpers import interrupt
from test_stage_std import assert_identical, assert_same_run

pytestmark = pytest.mark.stages
DDP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"
STD_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_std.py"
STEP_DUMP = KIT_ROOT / "tests" / "helpers" / "stage_step_dump.py"
STEPS = TWENTY_STEPS
# 2,048 tokens: the ddp stage on 2 processes takes 2 microbatches each (the first under no_sync,
# the second all-reduced); the std stage takes 4, the same samples in the same order.
GLOBAL_BATCH = ["--preset", "tiny", "--max-steps", "1", "--batch-tokens", "2048",
                "--sample-tokens", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def first_step(builtin_data, tmp_path_factory):
    """One optimiser step of each stage, run by the scripts' own main(): {"ddp": [rank 0's
    tensors, rank 1's], "std": [its tensors]} and each run's metrics under "<stage> metrics"."""
    root = tmp_path_factory.mktemp("first-step")
    args = [*GLOBAL_BATCH, "--data", builtin_data]
    torchrun(2, STEP_DUMP, DDP_SCRIPT, root / "ddp", *args, "--out", root / "ddp-run")
    std = subprocess.run(list(map(str, [sys.executable, STEP_DUMP, STD_SCRIPT, root / "std", *args,
                                        "--out", root / "std-run"])),
                         capture_output=True, text=True, timeout=300, env=kit_env(ONE_THREAD))
    assert std.returncode == 0, std.stderr[-3000:]
    return {"ddp": [load_file(root / "ddp" / f"rank{r}.safetensors") for r in (0, 1)],
            "std": [load_file(root / "std" / "rank0.safetensors")],
            "ddp metrics": runs.read_metrics(root / "ddp-run"),
            "std metrics": runs.read_metrics(root / "std-run")}


def tensors(dump, kind):
    return {name.removeprefix(f"{kind}."): t for name, t in dump.items() if name.startswith(kind)}


def test_ddp_gradients_equal_the_std_gradients_of_the_same_batch(first_step):
    ddp, std = tensors(first_step["ddp"][0], "grad"), tensors(first_step["std"][0], "grad")
    assert ddp.keys() == std.keys() and len(std) > 0
    for name, expected in std.items():
        torch.testing.assert_close(ddp[name], expected, rtol=1e-5, atol=1e-9, msg=name)
    # the gradients were clipped to norm 1, which hides their scale: the norms before clipping
    ddp_step, std_step = first_step["ddp metrics"][0], first_step["std metrics"][0]
    assert ddp_step["grad_norm"] == pytest.approx(std_step["grad_norm"], rel=1e-5)
    assert ddp_step["grad_norm"] > 1.0  # so clipping did act
    assert ddp_step["loss"] == pytest.approx(std_step["loss"], abs=1e-6)


def test_ddp_update_equals_the_std_update(first_step):
    """Adam's first step moves a weight by lr * g / (|g| + eps): about lr where |g| >> eps, and
    sensitive to the last bits of g where |g| is near eps (8.9e-7 seen). A thousandth of lr
    still catches any other learning rate or weight decay (lr * wd * |w| is ~6e-6 here)."""
    ddp, std = tensors(first_step["ddp"][0], "param"), tensors(first_step["std"][0], "param")
    lr = first_step["std metrics"][0]["lr"]
    assert first_step["ddp metrics"][0]["lr"] == lr
    assert ddp.keys() == std.keys()
    for name, expected in std.items():
        torch.testing.assert_close(ddp[name], expected, rtol=0, atol=1e-3 * lr, msg=name)


def test_both_ranks_hold_the_same_gradients_and_weights(first_step):
    rank0, rank1 = first_step["ddp"]
    assert rank0.keys() == rank1.keys()
    for name, tensor in rank0.items():
        assert torch.equal(rank1[name], tensor), name


@pytest.fixture(scope="module")
def two_process_run(builtin_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp20")
    result = torchrun(2, DDP_SCRIPT, *STEPS, "--data", builtin_data, "--out", out)
    return out, result.stdout


def test_two_processes_follow_std_at_the_same_global_batch(two_process_run, std_twenty_steps):
    out, stdout = two_process_run
    assert f"2 processes, backend {expected_backend()}, rank 0 on " in stdout
    assert stdout.count("step 1/20 ") == 1  # only rank 0 prints
    config = runs.read_json(out / "config.json")
    assert (config["stage"], config["world_size"], config["grad_accum"]) == ("ddp", 2, 1)
    ddp_metrics = runs.read_metrics(out)
    assert [r["step"] for r in ddp_metrics] == list(range(1, 21))
    for ddp, std in zip(ddp_metrics, runs.read_metrics(std_twenty_steps), strict=True):
        assert ddp["loss"] == pytest.approx(std["loss"], abs=1e-4)
        assert ddp.get("val_loss", 0) == pytest.approx(std.get("val_loss", 0), abs=1e-4)
    assert runs.load_checkpoint(out)[0] == 20


def test_one_process_without_torchrun_is_the_std_run(builtin_data, tmp_path, std_twenty_steps):
    result = run_stage("train_gpt2_ddp.py", *STEPS, "--data", builtin_data, "--out", tmp_path,
                       env=kit_env(ONE_THREAD))
    assert result.returncode == 0, result.stderr
    assert "1 processes, backend gloo, rank 0 on cpu" in result.stdout  # a group of one
    assert [r["loss"] for r in runs.read_metrics(tmp_path)] == \
           pytest.approx([r["loss"] for r in runs.read_metrics(std_twenty_steps)], abs=1e-6)


def test_preempted_run_resumes_like_an_uninterrupted_one(builtin_data, tmp_path, two_process_run):
    """SIGUSR1 reaches the ranks at different moments (as Slurm's does); they agree on a step,
    rank 0 checkpoints, all exit 0; the resumed run ends bit for bit where the reference did."""
    reference, _ = two_process_run
    args = [*STEPS, "--data", builtin_data, "--out", tmp_path]
    launcher = interrupt.start(torchrun_command(2, DDP_SCRIPT, *args), kit_env())
    lines = interrupt.read_until(launcher, "step 5/20 ")  # rank 0 has finished step 5
    for worker in psutil.Process(launcher.pid).children():
        worker.send_signal(signal.SIGUSR1)
        time.sleep(0.05)  # one rank learns of it a little later; they must still agree
    returncode, output = interrupt.finish(launcher, lines)
    assert returncode == 0, output[-3000:]
    stopped_at = runs.read_metrics(tmp_path)[-1]["step"]
    assert f"SIGUSR1 received: checkpoint saved at step {stopped_at}" in output
    assert 5 <= stopped_at < 20 and runs.load_checkpoint(tmp_path)[0] == stopped_at

    resumed = torchrun(2, DDP_SCRIPT, *args, "--resume")
    assert "resumed from" in resumed.stdout
    assert_same_run(runs.read_metrics(tmp_path), runs.read_metrics(reference))
    final, expected = runs.load_checkpoint(tmp_path), runs.load_checkpoint(reference)
    for part in ("model", "optimizer", "train_loader"):
        assert_identical(final[1][part], expected[1][part])


def test_batch_that_does_not_split_across_processes_is_refused(builtin_data, tmp_path):
    result = torchrun(2, DDP_SCRIPT, "--preset", "tiny", "--batch-tokens", "512", "--device",
                      "cpu", "--data", builtin_data, "--out", tmp_path, check=False)
    assert result.returncode != 0
    assert ("error: --batch-tokens 512 is not a multiple of micro-batch x seq-len x data-parallel "
            "processes = 4 x 128 x 2") in result.stderr


def test_each_rank_records_its_steps_and_the_time_it_took_to_reach_the_all_reduce(ddp_ten_steps):
    steps = runs.read_metrics(ddp_ten_steps)
    records = {rank: [json.loads(line) for line in
                      (ddp_ten_steps / "ranks" / f"{rank}.jsonl").read_text().splitlines()]
               for rank in (0, 1)}
    for rank_steps in records.values():
        assert [r["step"] for r in rank_steps] == [s["step"] for s in steps]
        assert all(0 < r["ready_s"] < r["step_s"] for r in rank_steps)
    # the step times are wall-clock time of this run: together no more than the time from the
    # run's config.json, which rank 0 writes before its first step, to the rank's last record.
    # Rank 1 may begin its first step before that file is written (nothing holds it back until
    # the step's all-reduce, which waits for rank 0): its later steps lie within that time.
    started = (ddp_ten_steps / "config.json").stat().st_mtime
    for rank, rank_steps in records.items():
        ended = (ddp_ten_steps / "ranks" / f"{rank}.jsonl").stat().st_mtime
        timed = rank_steps if rank == 0 else rank_steps[1:]
        assert 0 < sum(r["step_s"] for r in timed) <= ended - started
