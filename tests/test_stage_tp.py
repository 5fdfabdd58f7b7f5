"""The tp stage: tensor parallelism inside groups of --tp ranks and FSDP2 across the groups gives
the single-process logits and gradients (on dp=2 x tp=2), trains like DDP at 2 processes
(dp=1 x tp=2) and at 4 (dp=2 x tp=2), holds 1/(dp x tp) of the matrices per rank, resumes
exactly from its sharded checkpoints, and refuses in one line a --tp that does not fit."""
import json
import shutil

import pytest

from conftest import run_as_srun_tasks, torchrun
from coursekit import KIT_ROOT, presets, runs
from test_stage_fsdp import STEPS, TINY_PARAMETER_BYTES, losses

pytestmark = pytest.mark.stages
TP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_tp.py"
TP_CHECK = KIT_ROOT / "tests" / "helpers" / "tp_check.py"


def test_logits_and_gradients_equal_the_single_process_ones():
    """On the 2-dimensional mesh (dp=2 x tp=2), which holds the tensor-parallel pair of 2
    processes."""
    result = torchrun(4, TP_CHECK, TP_SCRIPT, 2)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["dp"], report["tp"]) == (2, 2)
    assert report["tied"]  # the embedding and lm_head still share one matrix
    assert report["max_logits_diff"] <= 1e-5
    assert report["max_grad_diff"] <= 1e-5 and report["max_tied_grad_diff"] <= 1e-5
    assert report["loss_diff"] <= 1e-5


@pytest.fixture(scope="module")
def ddp_two(ddp_ten_steps):
    return runs.read_metrics(ddp_ten_steps)


@pytest.fixture(scope="module")
def tp_runs(tp_ten_steps, builtin_data, tmp_path_factory):
    """Run directory and stdout of the tp stage at 2 processes (dp=1 x tp=2: conftest's, shared
    with export-hf) and 4 (dp=2 x tp=2); at 4, each TP group reads a 4 x 32-token microbatch: the
    same 256-token minibatch as DDP's (conftest.TEN_STEPS)."""
    out = tmp_path_factory.mktemp("tp4")
    result = torchrun(4, TP_SCRIPT, *STEPS, "--tp", 2, "--data", builtin_data, "--out", out)
    return {2: tp_ten_steps, 4: (out, result.stdout)}


@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_trains_like_ddp(tp_runs, ddp_two, nproc):
    out, stdout = tp_runs[nproc]
    assert f"{nproc} processes, backend " in stdout and f"mesh dp={nproc // 2} x tp=2" in stdout
    assert stdout.count("step 1/10 ") == 1
    assert runs.read_json(out / "config.json")["grad_accum"] == 2 // (nproc // 2)  # 2 / dp
    metrics = runs.read_metrics(out)
    assert [r["step"] for r in metrics] == list(range(1, 11))
    assert losses(metrics) == pytest.approx(losses(ddp_two), abs=1e-4)


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_rank_holds_its_slice_of_every_matrix(tp_runs, nproc):
    """Tensor parallelism splits the matrices over tp and replicates the LayerNorms and the output
    projections' biases (6 vectors of n_embd per block, 2 for ln_f); FSDP splits both over dp."""
    tiny, dp, tp = presets.get_preset("tiny"), nproc // 2, 2
    replicated = (6 * tiny.n_layer + 2) * tiny.n_embd * 4  # fp32 bytes
    expected = ((TINY_PARAMETER_BYTES - replicated) / tp + replicated) / dp
    out, stdout = tp_runs[nproc]
    reports = runs.read_json(out / "memory.json")
    assert len(reports) == nproc
    for rank, report in enumerate(reports):
        assert report["params"] == expected
        assert report["grads"] == report["params"]
        assert report["optimizer"] == pytest.approx(2 * report["params"], rel=0.01)  # Adam: m, v
        assert f"rank {rank} | params " in stdout


def test_a_two_dimensional_checkpoint_resumes_exactly(tp_runs, builtin_data, tmp_path):
    out, _ = tp_runs[4]
    copy = tmp_path / "run"  # the run as it was after step 5
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "ckpt" / "step_00000010")
    runs.write_json_atomic(copy / "ckpt" / "latest.json", {"dir": "step_00000005", "step": 5})
    result = torchrun(4, TP_SCRIPT, *STEPS, "--tp", 2, "--resume", "--data", builtin_data,
                      "--out", copy)
    assert f"resumed from {copy / 'ckpt' / 'step_00000005'} at step 5" in result.stdout
    resumed, reference = runs.read_metrics(copy), runs.read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert losses(resumed[5:]) == losses(reference[5:])  # bit for bit, as std and ddp resume


def test_memory_options_keep_the_losses(tp_runs, builtin_data, tmp_path):
    reference, _ = tp_runs[2]
    torchrun(2, TP_SCRIPT, *STEPS, "--tp", 2, "--activation-checkpointing", "--cpu-offload",
             "--data", builtin_data, "--out", tmp_path)
    assert losses(runs.read_metrics(tmp_path)) == \
           pytest.approx(losses(runs.read_metrics(reference)), abs=1e-6)


@pytest.mark.parametrize("nproc, tp, allowed", [(2, 3, "1, 2"), (1, 8, "1")])
def test_a_tp_that_does_not_fit_is_refused_in_one_line(builtin_data, tmp_path, nproc, tp,
                                                       allowed):
    """--tp must divide the processes, the heads (4 in tiny) and the sequence; every task says
    so before it joins the others (here as `srun python` tasks: torchrun adds its own report)."""
    tasks = run_as_srun_tasks("train_gpt2_tp.py", nproc, "--preset", "tiny", "--tp", tp,
                              "--device", "cpu", "--data", builtin_data, "--out", tmp_path,
                              timeout=120)
    for task in tasks:
        assert task.returncode != 0
        assert "Traceback" not in task.stderr
        assert task.stderr.count("\n") == 1, task.stderr
        assert task.stderr.startswith(f"train_gpt2_tp.py: error: --tp {tp} must divide the "
                                      f"number of processes ({nproc})")
        assert task.stderr.strip().endswith(f"choose from {allowed}")
