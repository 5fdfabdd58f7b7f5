"""`python -m coursekit selftest` on this machine's CPU, as an instructor runs it on a new node: the
stages train, the report says what it measured, and a failure is one line. Here with the tensor-
parallel stage alone (--stages tp), which needs 2 processes of one node; the self-test's batch file
trains across the 2 nodes of the Slurm test cluster (tests/test_slurm.py)."""
import json
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, bandwidth, grading, selftest

pytestmark = pytest.mark.stages
STEPS = 3


def selftest_command(out, *args):
    return [sys.executable, "-m", "coursekit", "selftest", "--out", str(out), "--steps",
            str(STEPS), *map(str, args)]


@pytest.fixture(scope="module")
def passed(builtin_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("selftest")
    result = subprocess.run(selftest_command(out, "--data", builtin_data, "--stages", "tp"),
                            capture_output=True, text=True, cwd=KIT_ROOT, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
    sizes = report["allreduce"]["sizes"]
    assert report["allreduce"]["ranks"] == 2 and report["allreduce"]["backend"] == "gloo"
    assert [s["bytes"] for s in sizes] == bandwidth.sizes(selftest.LARGEST_MESSAGE["cpu"])
    for s in sizes:  # busbw = algbw x 2 (n - 1) / n: equal for two ranks
        assert s["algbw"] == pytest.approx(s["bytes"] / s["seconds"]) == pytest.approx(s["busbw"])


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
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    result = subprocess.run(selftest_command(tmp_path, "--data", builtin_data, "--preset",
                                             "small"), capture_output=True, text=True,
                            cwd=KIT_ROOT, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert report["ok"] and report["plan"]["device"] == "cuda"
    for run in report["runs"]:
        if run["peak_bytes"] is not None:
            assert run["peak_bytes"] <= run["predicted_bytes"], run
