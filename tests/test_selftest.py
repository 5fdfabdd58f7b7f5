"""`python -m coursekit selftest` on this machine's CPU, as an instructor runs it on a new node: the
stages train, the report says what it measured, and a failure is one line. Here with the tensor-
parallel stage alone (--stages tp), which needs 2 processes of one node; the self-test's batch file
trains across the 2 nodes of the Slurm test cluster (tests/test_slurm.py)."""
import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, bandwidth, cli, grading, presets, selftest, slurm

pytestmark = pytest.mark.stages
STEPS = 3


def selftest_command(out, *args, device="cpu"):
    """The self-test on the CPU's processes, also on a GPU machine: what the tests check of it
    (2 processes per node, fp32) is the CPU's plan."""
    return [sys.executable, "-m", "coursekit", "selftest", "--out", str(out), "--steps",
            str(STEPS), "--device", device, *map(str, args)]


EXPECTED_BUSBW = 0.001  # GB/s: what gloo gives on loopback is more


@pytest.fixture(scope="module")
def passed(builtin_data, std_twenty_steps, tmp_path_factory):
    """The self-test started from a folder of its own, not the kit's, into a relative --out that
    an earlier self-test left a checkpoint in (the std run of 20 steps stands for it): the
    instructor's second self-test after a fix."""
    folder = tmp_path_factory.mktemp("instructor")
    shutil.copytree(std_twenty_steps, folder / "selftest" / "runs" / "std-1")
    result = subprocess.run(selftest_command("selftest", "--data", builtin_data, "--stages", "tp",
                                             "--expected-busbw", EXPECTED_BUSBW),
                            capture_output=True, text=True, cwd=folder, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = folder / "selftest"
    return out, result.stdout, json.loads((out / "selftest.json").read_text())


def test_the_chosen_stage_trains_as_std_does_on_one_process(passed):
    _, stdout, report = passed
    assert report["ok"] and report["failures"] == []
    ran = [(r["stage"], r["processes"]) for r in report["runs"]]
    assert ran == [("std", 1), ("tp", 2)]  # std, the reference, and the stage asked for
    reference = report["runs"][0]["losses"]
    for run in report["runs"]:
        assert run["ok"] and len(run["losses"]) == STEPS, run
        assert max(abs(a - b) for a, b in zip(run["losses"], reference)) <= selftest.TOLERANCE["fp32"]
        assert run["tok_per_s"] > 0 and 0 < run["step_ms"] and run["predicted_bytes"] > 0
    assert all(run["peak_bytes"] > 0 for run in report["runs"] if run["stage"] != "lit")
    assert "self-test passed" in stdout


def test_the_checks_find_what_the_lessons_need_offline(passed):
    _, _, report = passed
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["torch", "devices", "data", "tokenizer", "Hugging Face cache",
                            "lesson imports", "all-reduce"]
    assert all(c["ok"] for c in checks.values())
    lessons = len(grading.lessons(KIT_ROOT))
    assert checks["lesson imports"]["detail"] == f"the first cells of {lessons} lessons import"
    assert checks["devices"]["detail"].endswith("2 processes per node, fp32")


def test_the_all_reduce_is_measured_over_growing_messages(passed):
    _, _, report = passed
    check = next(c for c in report["checks"] if c["name"] == "all-reduce")
    assert check["detail"].startswith("2 ranks over gloo (gloo): bus bandwidth up to ")
    assert check["detail"].endswith(f" GB/s of {EXPECTED_BUSBW:g} GB/s expected")
    sizes = report["allreduce"]["sizes"]
    assert report["allreduce"]["ranks"] == 2 and report["allreduce"]["backend"] == "gloo"
    # 1 KiB, then each message four times the last, up to 16 MiB on CPU processes
    assert [s["bytes"] for s in sizes] == [2**10 * 4**k for k in range(8)]
    for s in sizes:  # busbw = algbw x 2 (n - 1) / n: equal for two ranks
        assert s["algbw"] == pytest.approx(s["bytes"] / s["seconds"]) == pytest.approx(s["busbw"])
    # growing messages take longer, and amortise the start-up latency of each all-reduce: 16,384
    # times the bytes of the smallest move at a higher bandwidth
    assert sizes[-1]["seconds"] > sizes[0]["seconds"] and sizes[-1]["busbw"] > sizes[0]["busbw"]


def test_the_summary_is_markdown_an_instructor_can_keep(passed):
    out, _, report = passed
    summary = (out / "selftest.md").read_text()
    assert summary.startswith(f"# Self-test of {report['host']}") and "\n**PASS**\n" in summary
    assert summary.count("\n| tp | 2 | ok |") == 1
    assert "## All-reduce: 2 ranks, gloo" in summary and "| 16 MiB |" in summary


def test_bus_bandwidth_is_nccl_tests_formula():
    # 8 ranks: each link carries 2 x 7/8 of the buffer
    assert bandwidth.bus_bandwidth(1e9, 0.5, 8) == (2e9, 3.5e9)
    assert bandwidth.sizes(2**14) == [1024, 4096, 16384]


#: What NCCL_DEBUG=INFO prints of the connections it made (NCCL 2.21's format), one job each
NCCL_LOGS = {
    "infiniband": "node1:1:1 [0] NCCL INFO Using network IB\n"
                  "node1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n"
                  "node1:1:1 [1] NCCL INFO Channel 00/0 : 3[1] -> 4[0] [send] via NET/IB/0/GDRDMA\n",
    "slingshot": "nid1:1:1 [0] NCCL INFO Using network AWS Libfabric\n"
                 "nid1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
                 "nid1:1:1 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/AWS Libfabric/0\n",
    "sockets": "gpu1:1:1 [0] NCCL INFO Using network Socket\n"
               "gpu1:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0\n",
    "no p2p": "gpu1:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n",
}


@pytest.mark.parametrize("job, transports", [
    ("infiniband", ["NET/IB", "P2P/IPC"]), ("slingshot", ["NET/OFI", "P2P/CUMEM"]),
    ("sockets", ["NET/Socket"]), ("no p2p", ["SHM/direct"])])
def test_the_transports_nccl_chose_are_read_from_its_log(job, transports):
    assert selftest.nccl_transports(NCCL_LOGS[job]) == transports


@pytest.mark.parametrize("job, nodes, cause", [
    ("sockets", 2, "NCCL fell back to TCP sockets"),
    ("no p2p", 1, "the GPUs of the node do not talk peer to peer"),
    ("infiniband", 2, "a slow, shared or misconfigured link"),
])
def test_a_bus_bandwidth_below_half_the_sites_fails_with_its_likely_cause(job, nodes, cause):
    plan = selftest.Plan("cuda", 4, nodes, "gpt2-124m", 16, 1024, 20, "bf16", "data", "out",
                         "node1", expected_busbw=200)
    measured = {"ranks": 4 * nodes, "backend": "nccl",
                "transports": selftest.nccl_transports(NCCL_LOGS[job])}
    slow = selftest.bandwidth_verdict(99.9, plan, measured)
    assert not slow.ok
    assert f"up to 99.90 GB/s of 200 GB/s expected, below half: {cause}" in slow.detail
    assert selftest.bandwidth_verdict(100.0, plan, measured).ok  # half is enough


def test_data_too_small_for_a_microbatch_on_every_process_fails_before_training(builtin_data):
    """GPT-2 124M's micro-batch of 16 x 1024 on 4 GPUs needs 65,537 tokens; the builtin corpus's
    validation split has 35,134."""
    plan = selftest.Plan("cuda", 4, 1, "gpt2-124m", 16, 1024, 20, "bf16", str(builtin_data),
                         "out", "127.0.0.1")
    result = selftest.check_data(plan)
    assert not result.ok and result.detail.startswith(
        f"the val split of {builtin_data} has 35,134 tokens, fewer than a microbatch of 16 x 1024 "
        "tokens on each of 4 processes needs (65,537): prepare the site's data")
    assert selftest.check_data(dataclasses.replace(plan, micro_batch=8, per_node=4,
                                                   seq_len=1024)).ok  # 32,769 tokens fit


def test_an_mfu_above_100_percent_fails_its_run(std_twenty_steps, tmp_path):
    """A step that did more arithmetic than the device's peak allows says the peak is wrong."""
    run_dir = tmp_path / "std-1"
    shutil.copytree(std_twenty_steps, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "peak_flops": 1e3}))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({**m, "mfu": m["tok_per_s"] * config["flops_per_token"] / 1e3}) + "\n"
        for m in metrics))
    plan = selftest.Plan("cpu", 1, 1, "tiny", 4, 128, 20, "fp32", "data", str(tmp_path),
                         "127.0.0.1")
    run = selftest.Run("std", 1)
    selftest.measure(plan, run, run_dir)
    assert not run.ok and run.detail.startswith("its MFU is ") and "outside 0-100%" in run.detail


def test_a_loss_that_strays_from_std_fails_its_run():
    plan = selftest.Plan("cpu", 2, 1, "tiny", 4, 128, 3, "bf16", "data", "out", "127.0.0.1")
    std = selftest.Run("std", 1, ok=True, losses=[10.8, 10.6, 10.4])
    close = selftest.Run("ddp", 2, ok=True, losses=[10.81, 10.62, 10.43])
    far = selftest.Run("fsdp", 2, ok=True, losses=[10.8, 10.7, 10.6])
    for run in (close, far):
        selftest.compare_losses(plan, std, run)
    assert close.ok and close.loss_difference == pytest.approx(0.03)
    assert not far.ok and far.detail == ("its loss differs from the std stage's by up to 0.2000 "
                                         "(more than 0.05 for bf16)")


def test_missing_data_fails_in_one_line_that_says_how_to_prepare_it(tmp_path):
    result = subprocess.run(selftest_command(tmp_path / "out", "--data", tmp_path / "none"),
                            capture_output=True, text=True, cwd=KIT_ROOT, timeout=600)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: self-test failed: data: no prepared data in "
                                    f"{tmp_path / 'none'}")
    assert "python -m coursekit data prepare --source builtin" in result.stderr
    report = json.loads((tmp_path / "out" / "selftest.json").read_text())
    assert not report["ok"] and report["runs"] == []  # nothing trains without data


def test_first_cell_imports_are_the_import_statements_of_the_first_code_cell():
    lesson = ("# %% [markdown]\n# # A lesson\n\n# %%\nimport os\nfrom pathlib import Path\n"
              "x = 1\nimport torch  # later, still top level\n\n# %%\nimport json\n")
    assert selftest.first_cell_imports(lesson) == ["import os", "from pathlib import Path",
                                                    "import torch"]


@pytest.mark.gpu
def test_the_selftest_passes_on_every_gpu_of_this_node(builtin_data, tmp_path):
    """On a GPU node: every stage on one GPU and on all of them, bf16 (or fp16) losses within
    the tolerance of the std stage's, the measured peak memory below coursekit.memory's
    prediction (the generator's micro-batches rely on it)."""
    result = subprocess.run(selftest_command(tmp_path, "--data", builtin_data, "--preset",
                                             "small", device="cuda"), capture_output=True, text=True,
                            cwd=KIT_ROOT, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert report["ok"] and report["plan"]["device"] == "cuda"
    for run in report["runs"]:
        if run["peak_bytes"] is not None:
            assert run["peak_bytes"] <= run["predicted_bytes"], run


def test_a_course_plan_takes_its_jobs_run_times_from_the_self_test(passed, capsys):
    """`coursekit plan` on the test cluster with this self-test's report: a job of a stage it
    measured (std, tp) trains the ci profile's steps at the measured tokens/s per process, times
    its processes; one of a stage it did not run (fsdp) keeps its time limit."""
    out, _, report = passed
    assert cli.main(["plan", "5-days", "--site", "ci", "--trainees", "1", "--selftest",
                     str(out / "selftest.json"), "--json"]) == 0
    jobs = {job["file"]: job for day in json.loads(capsys.readouterr().out)["days"]
            for job in day["jobs"]}
    steps = int(re.search(r"--max-steps (\d+)", slurm.load_site("ci")["train_args"]).group(1))
    tokens = steps * presets.get_preset("tiny").batch_tokens
    rate = {run["stage"]: run["tok_per_s"] / run["processes"] for run in report["runs"]}
    for name, stage, processes in (("batch-std-1n1g.sh", "std", 1), ("batch-tp-1n2g.sh", "tp", 2),
                                   ("batch-tp-2n2g.sh", "tp", 4)):
        assert jobs[name]["hours_from"] == "self-test"
        assert jobs[name]["hours"] == pytest.approx(tokens / (rate[stage] * processes) / 3600)
    assert (jobs["batch-fsdp-1n2g.sh"]["hours"], jobs["batch-fsdp-1n2g.sh"]["hours_from"]) == \
        (pytest.approx(10 / 60), "time limit")
