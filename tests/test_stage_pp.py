"""The pp stage: a pipeline step's loss and gradients equal a single process's for every schedule;
2 stages train like DDP, keep the two copies of the tied embedding equal, hold their own parts of
the model, and resume from a checkpoint; one process needs no launcher; bad layouts are refused."""
import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import TEN_STEPS, run_stage, torchrun
from coursekit import KIT_ROOT, runs
from test_stage_fsdp import checkpoint_at_step_5, losses

pytestmark = pytest.mark.stages
PP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_pp.py"
SCHEDULES = ["gpipe", "1f1b"]
STEPS = TEN_STEPS  # as ddp's reference run; each run below says how long a sample it writes
TINY_PARAMETER_BYTES = 3_427_712 * 4  # fp32
TIED_MATRIX_BYTES = 50_304 * 64 * 4  # the token embedding = the output head, vocab x width


# the schedules each pipeline length is checked with (1F1B needs as many microbatches as stages)
STEP_CHECKS = {2: SCHEDULES, 4: ["1f1b"]}


@pytest.fixture(scope="module")
def step_reports():
    """{(processes, schedule): pp_check.py's report}, one launch per number of processes that
    checks every schedule, made when a test first asks."""
    reports = {}

    def report(nproc, schedule):
        if (nproc, schedule) not in reports:
            result = torchrun(nproc, KIT_ROOT / "tests" / "helpers" / "pp_check.py", PP_SCRIPT,
                              ",".join(STEP_CHECKS[nproc]), 4)
            for line in result.stdout.strip().splitlines()[-len(STEP_CHECKS[nproc]):]:
                checked = json.loads(line)
                reports[nproc, checked["schedule"]] = checked
        return reports[nproc, schedule]
    return report


@pytest.mark.parametrize("nproc, schedule", [(n, s) for n, schedules in STEP_CHECKS.items()
                                             for s in schedules])
def test_a_pipeline_step_equals_the_single_process_step(step_reports, nproc, schedule):
    report = step_reports(nproc, schedule)
    assert (report["world_size"], report["schedule"]) == (nproc, schedule)
    assert report["names_covered_once"] and report["names_missing"] == []
    for difference in ("max_loss_diff", "max_logits_diff", "max_grad_diff", "grad_norm_diff"):
        assert report[difference] <= 1e-5, report


@pytest.fixture(scope="module")
def ddp_two(ddp_ten_steps):
    """10 steps of ddp on 2 processes, as STEPS."""
    return runs.read_metrics(ddp_ten_steps)


@pytest.fixture(scope="module")
def pp_two(pp_ten_steps, builtin_data, tmp_path_factory):
    """10 steps of a 2-stage pipeline with each schedule, ending with an 8-token sample:
    {schedule: (run directory, stdout)}; 1F1B's is conftest's, shared with export-hf."""
    out = tmp_path_factory.mktemp("pp2-gpipe")
    result = torchrun(2, PP_SCRIPT, *STEPS, "--schedule", "gpipe", "--sample-tokens", "8",
                      "--data", builtin_data, "--out", out)
    return {"gpipe": (out, result.stdout), "1f1b": pp_ten_steps}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_stages_train_like_ddp(pp_two, ddp_two, schedule):
    out, stdout = pp_two[schedule]
    assert (f"pipeline: 2 stages, schedule {schedule}, 2 microbatches of 4 samples; the blocks of "
            "each stage: [[0, 1], [2, 3]]") in stdout
    assert stdout.count("step 1/10 ") == 1  # only rank 0 prints
    pp = runs.read_metrics(out)
    assert [r["step"] for r in pp] == list(range(1, 11))
    assert losses(pp) == pytest.approx(losses(ddp_two), abs=1e-4)


def stage_checkpoint(run_dir, step, tmp_path):
    """The checkpoint's state, every rank's stage in one nested dict (read without a process
    group; plain tensors, no code unpickled)."""
    path = tmp_path / f"step_{step}.pt"
    dcp_to_torch_save(run_dir / "ckpt" / f"step_{step:08d}", path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_two_copies_of_the_tied_embedding_stay_equal(pp_two, tmp_path, schedule):
    out, _ = pp_two[schedule]
    state = stage_checkpoint(out, 10, tmp_path)
    model, optimizer = state["model"], state["optimizer"]
    assert torch.equal(model["transformer.wte.weight"], model["lm_head.weight"])  # rank 0, 1
    for moment in ("exp_avg", "exp_avg_sq"):  # the same gradients went into both
        assert torch.equal(optimizer[f"state.transformer.wte.weight.{moment}"],
                           optimizer[f"state.lm_head.weight.{moment}"])


def test_each_rank_holds_its_stage(pp_two):
    out, stdout = pp_two["1f1b"]
    reports = runs.read_json(out / "memory.json")
    assert len(reports) == 2
    # the stages hold the whole model between them, and the tied matrix twice
    assert sum(r["params"] for r in reports) == TINY_PARAMETER_BYTES + TIED_MATRIX_BYTES
    for rank, report in enumerate(reports):
        assert report["params"] > TIED_MATRIX_BYTES
        assert report["grads"] == report["params"]
        assert report["optimizer"] == pytest.approx(2 * report["params"], rel=0.01)  # Adam: m, v
        assert report["peak"] > report["params"] and report["peak_kind"] == "RSS"
        assert f"rank {rank} | params " in stdout


def test_resume_continues_the_same_pipeline(pp_two, builtin_data, tmp_path):
    out, _ = pp_two["1f1b"]  # one schedule is enough: the checkpoints do not depend on it
    copy = checkpoint_at_step_5(out, tmp_path / "run")
    result = torchrun(2, PP_SCRIPT, *STEPS, "--schedule", "1f1b", "--sample-tokens", "0",
                      "--resume", "--data", builtin_data, "--out", copy)
    assert f"resumed from {copy / 'ckpt' / 'step_00000005'} at step 5" in result.stdout
    resumed, reference = runs.read_metrics(copy), runs.read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert losses(resumed[5:]) == pytest.approx(losses(reference[5:]), abs=1e-5)


def test_one_process_needs_no_launcher(builtin_data, tmp_path, ddp_two, pp_two):
    """A pipeline of one stage (a group of one, in memory), here with activation checkpointing:
    it trains like DDP and samples the text that the 2-stage pipeline sampled."""
    two_stage_run, _ = pp_two["gpipe"]
    result = run_stage("train_gpt2_pp.py", *STEPS, "--sample-tokens", "8",
                       "--activation-checkpointing", "--data", builtin_data, "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr  # no noise at exit
    assert "pipeline: 1 stages" in result.stdout
    assert losses(runs.read_metrics(tmp_path)) == pytest.approx(losses(ddp_two), abs=1e-4)
    assert (tmp_path / "sample.txt").read_text() == (two_stage_run / "sample.txt").read_text()


@pytest.mark.parametrize("nproc, flags, message", [
    (3, ["--n-layer", "2"], "error: 3 processes for a 2-block model: a pipeline has one stage "
                            "per process and at least a block per stage"),
    (2, ["--schedule", "1f1b", "--micro-batch", "8"],
     "error: --schedule 1f1b needs a microbatch per stage: 1 microbatches < 2 stages (lower "
     "--micro-batch, or --schedule gpipe)"),
])
def test_pipelines_torch_cannot_run_are_refused(builtin_data, tmp_path, nproc, flags, message):
    result = torchrun(nproc, PP_SCRIPT, "--preset", "tiny", *flags, "--data", builtin_data,
                      "--out", tmp_path, check=False)
    assert result.returncode != 0 and message in result.stderr
    assert f'File "{PP_SCRIPT}"' not in result.stderr  # a message, not the script's traceback
