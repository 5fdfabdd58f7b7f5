"""Faults a cluster throws at a run, each caused for real, and what the kit does about them: a rank
that hangs or dies inside a collective (the others stop within the timeout and say which
collective), a crashed process (torchrun starts the group again, which resumes from its
checkpoint and ends where an uninterrupted run does; a crash beyond the restarts fails with the
checkpoint intact), a disk that fills while a checkpoint is written (one line, nothing lost). A process fails where tests/helpers/fault/sitecustomize.py makes it."""
import os
import re
import resource
import shutil
import sys
import time

import psutil
import pytest

from conftest import (ONE_THREAD, TEN_STEPS, TWENTY_STEPS, kit_env, run_stage, torchrun,
                      torchrun_command)
from coursekit import KIT_ROOT, faults, runs
from helpers import interrupt
from test_stage_std import assert_identical, assert_same_run

pytestmark = pytest.mark.stages
DDP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"
FAULT_HOOK = KIT_ROOT / "tests" / "helpers" / "fault"


def faulty(action, rank, step, launches=1):
    """The environment of a run whose process of `rank` `action`s (hangs, dies) right after
    printing the line of `step`, in torchrun's first `launches` launches of the group."""
    path = os.pathsep.join(filter(None, [str(FAULT_HOOK), os.environ.get("PYTHONPATH")]))
    return kit_env({"PYTHONPATH": path, "KIT_FAULT": f"{action} {rank} {step}",
                    "KIT_FAULT_LAUNCHES": str(launches)})


def test_a_hung_rank_stops_the_others_within_the_timeout_naming_the_collective(builtin_data,
                                                                                 tmp_path):
    """Before the timeout, each rank's watchdog writes its stacks: where the hung rank is stuck,
    and the collective the other waits in."""
    timeout, watchdog = 5, 2
    command = torchrun_command(2, DDP_SCRIPT, *TEN_STEPS, "--data", builtin_data, "--out",
                               tmp_path)
    launcher = interrupt.start(command, {**faulty("hangs", 1, 3), "KIT_DIST_TIMEOUT": str(timeout),
                                         "KIT_WATCHDOG": str(watchdog)})
    try:
        interrupt.read_until(launcher, "step 3/10 ")  # rank 1 hangs from here on
        hung_at = time.monotonic()
        error = interrupt.read_until(launcher, "error: ")[-1]
        waited = time.monotonic() - hung_at
    finally:  # torchrun would wait 30 s more for the hung rank to take its SIGTERM
        for process in [*psutil.Process(launcher.pid).children(recursive=True), launcher]:
            process.kill()
        launcher.wait()
    # no sooner than the timeout; a busy machine can only make it later, but not by minutes:
    # torch's own timeout for gloo, 30 minutes, did not fire in its place
    assert timeout <= waited < 300
    # rank 0 waits in the next collective: DDP's gradient all-reduce of step 4
    assert re.match(rf"error: rank 0 of 2: the gradient all-reduce in backward \(DDP\) at "
                    rf"train_gpt2_ddp\.py:\d+ \(precision\.scaler\.scale\(loss\)\.backward\(\)\) "
                    rf"did not complete within "
                    rf"{timeout} s \(KIT_DIST_TIMEOUT\): another process hung", error)
    assert "the last checkpoint is intact: run the same command again with --resume" in error
    # each stall appends its stacks: under load a slow first step may have written some before
    stall = f"--- no step ended within {watchdog} s after step 3 ---"
    stuck, waiting = ((tmp_path / "ranks" / f"{rank}.stacks").read_text().partition(stall)[2]
                      for rank in (1, 0))
    assert stuck and waiting, "a rank wrote no stacks for the stall after step 3"
    assert re.search(r'File ".*/sitecustomize\.py", line \d+ in print_then_fail', stuck), stuck
    assert re.search(r"line \d+ in forward_backward\n.* in main", waiting), waiting  # in backward


def test_a_crashed_rank_restarts_the_group_which_ends_like_an_uninterrupted_run(
        builtin_data, tmp_path, ddp_ten_steps):
    result = torchrun(2, DDP_SCRIPT, *TEN_STEPS, "--data", builtin_data, "--out", tmp_path,
                      "--resume", restarts=1, env=faulty("dies", 1, 7))
    output = result.stdout + result.stderr
    assert re.search(r"error: rank 0 of 2: .+ at train_gpt2_ddp\.py:\d+ \(.+\) lost a peer: "
                     "another process died", output), output[-3000:]
    assert f"resumed from {tmp_path}/ckpt/step_00000005 at step 5" in output
    assert_same_run(runs.read_metrics(tmp_path), runs.read_metrics(ddp_ten_steps))
    final, expected = runs.load_checkpoint(tmp_path), runs.load_checkpoint(ddp_ten_steps)
    for part in ("model", "optimizer", "train_loader"):
        assert_identical(final[1][part], expected[1][part])


def test_a_crash_beyond_the_restarts_fails_and_keeps_the_checkpoint(builtin_data, tmp_path):
    """Rank 1 dies after step 3 in both launches; both times rank 0 loses it in step 4."""
    args = ["--preset", "tiny", "--max-steps", "4", "--ckpt-interval", "2", "--eval-steps", "1",
            "--sample-tokens", "0", "--device", "cpu", "--data", builtin_data, "--out", tmp_path]
    result = torchrun(2, DDP_SCRIPT, *args, "--resume", restarts=1, check=False,
                      env=faulty("dies", 1, 3, launches=2))
    assert result.returncode != 0
    assert "resumed from" in result.stdout  # the restart, which crashed again
    assert result.stderr.count("lost a peer: another process died") == 2
    assert runs.checkpoint_step(runs.checkpoint_to_resume(tmp_path)) == 2
    assert [r["step"] for r in runs.read_metrics(tmp_path)] == [1, 2, 3]


PP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_pp.py"


def test_a_failure_a_restart_cannot_mend_is_not_restarted(builtin_data, tmp_path):
    """torchrun starts the group twice more (--max-restarts=2, as the batch files say), but the
    restarted processes stop before they start, with the first attempt's line. (Which process of
    an attempt says so first is a race: torchrun stops the other when one has failed.)"""
    result = torchrun(2, PP_SCRIPT, "--preset", "tiny", "--micro-batch", "4", "--batch-tokens",
                      "512", "--device", "cpu", "--data", builtin_data, "--out", tmp_path,
                      restarts=2, check=False)
    first_error = "--schedule 1f1b needs a microbatch per stage: 1 microbatches < 2 stages"
    assert result.returncode != 0 and f"error: {first_error}" in result.stderr
    repeated = re.findall(r"error: not restarted, as a restart cannot mend it: (.*)",
                          result.stderr)
    # both restarts happened, and stopped: at least one process of each said why
    assert 2 <= len(repeated) <= 4 and all(line.startswith(first_error) for line in repeated), \
        repeated
    assert result.stdout.count("2 processes, backend gloo") == 1  # only the first started


@pytest.mark.parametrize("failure, remembered", [
    (lambda: sys.exit(2), "exit 2: the command line was refused (its error above)"),
    (lambda: None + 1, "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'"),
    (lambda: sys.exit(0), None),  # a clean exit is no failure
], ids=["bad-argument", "bug", "clean-exit"])
def test_what_torchruns_next_attempt_finds_of_the_first(tmp_path, monkeypatch, failure,
                                                       remembered):
    """torchrun's folder for a launch's attempts, as it gives it to its processes."""
    launch = tmp_path / "torchelastic_x" / "none_y"
    (launch / "attempt_0" / "0").mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(launch / "attempt_0" / "0" / "error.json"))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises((SystemExit, TypeError)):
        faults.run(failure)
        sys.exit(0)  # a clean run returns
    marker = launch / faults.FAILED_FIRST
    assert (marker.read_text() if marker.exists() else None) == remembered
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    started = []
    result = faults.run(lambda: started.append(True) or 0)
    assert (result, started) == ((f"error: not restarted, as a restart cannot mend it: "
                                  f"{remembered}", []) if remembered else (0, [True]))


def test_a_disk_that_fills_during_a_checkpoint_loses_nothing(builtin_data, tmp_path,
                                                               std_twenty_steps):
    """The checkpoint of step 20 finds no room (RLIMIT_FSIZE: each file at most 1 MB, and the
    checkpoint's tensors take 41 MB): the run stops with one line, the checkpoint of step 10 and
    metrics.jsonl stay as they were, and the run resumed with room ends as the reference did."""
    shutil.copytree(std_twenty_steps, tmp_path, dirs_exist_ok=True)  # a run stopped at step 10:
    shutil.rmtree(tmp_path / "ckpt" / "step_00000020")                # its checkpoint, bit for bit
    runs.truncate_metrics(tmp_path, 10)
    runs.write_json_atomic(tmp_path / "ckpt" / "latest.json", {"dir": "step_00000010", "step": 10})
    args = [*TWENTY_STEPS, "--data", builtin_data, "--out", tmp_path, "--resume"]

    def one_megabyte_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, 2 ** 20))

    full = run_stage("train_gpt2_std.py", *args, env=kit_env(ONE_THREAD),
                     preexec_fn=one_megabyte_files)
    assert full.returncode == 1
    assert re.fullmatch(rf"error: no room to write checkpoint {tmp_path}/ckpt/step_00000020 \(File "
                        rf"too large\): it needs [\d,]+ bytes and its file system has [\d,]+ free; "
                        rf"{tmp_path}/ckpt/step_00000010 is intact: make room, or give --out "
                        r"another place, and run again with --resume\n", full.stderr), full.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest.json", "step_00000010"]
    assert runs.checkpoint_problem(tmp_path, tmp_path / "ckpt" / "step_00000010") is None
    assert_same_run(runs.read_metrics(tmp_path), runs.read_metrics(std_twenty_steps))  # 20 lines

    resumed = run_stage("train_gpt2_std.py", *args, env=kit_env(ONE_THREAD))
    assert "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_run(runs.read_metrics(tmp_path), runs.read_metrics(std_twenty_steps))
    final, expected = runs.load_checkpoint(tmp_path), runs.load_checkpoint(std_twenty_steps)
    for part in ("model", "optimizer", "train_loader"):
        assert_identical(final[1][part], expected[1][part])


def test_a_diverging_run_stops_at_its_first_infinite_gradient_before_checkpointing_it(
        builtin_data, tmp_path):
    """A learning rate 1,000 times too high: step 2's gradients overflow. The run stops there with
    one line, its record written and its weights not checkpointed."""
    result = run_stage("train_gpt2_std.py", *TEN_STEPS, "--ckpt-interval", 1, "--lr", 1000,
                       "--warmup-steps", 0, "--data", builtin_data, "--out", tmp_path,
                       env=kit_env(ONE_THREAD))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert re.match(r"error: the loss is \S+ and the gradient norm inf at step 2: the weights are "
                    r"lost from this step on", result.stderr)
    assert [r["step"] for r in runs.read_metrics(tmp_path)] == [1, 2]
    assert runs.load_checkpoint(tmp_path)[0] == 1


def test_memory_that_runs_out_is_one_line_with_the_fixes(builtin_data, tmp_path):
    """A process limited to 3 GB of address space, with a micro-batch whose logits' gradient
    alone takes 0.8 GB (a tiny step takes 1.6 GB at micro-batch 4, 5.7 GB at 32)."""
    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 * 10**9, 3 * 10**9))

    result = run_stage("train_gpt2_std.py", *TEN_STEPS, "--max-steps", 1, "--micro-batch", 32,
                       "--seq-len", 128, "--batch-tokens", 32 * 128, "--data", builtin_data,
                       "--out", tmp_path, env=kit_env(ONE_THREAD), preexec_fn=limit_memory)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    # where the training code ran out: the loss in the model's forward (solutions/gpt.py) or the
    # script's backward, as the process's address space happens to be laid out
    assert re.match(r"error: out of memory allocating \d+ bytes at (train_gpt2_std|gpt)\.py:\d+ "
                    r"\(.+\): lower --micro-batch \(the same --batch-tokens trains the same",
                    result.stderr), result.stderr
