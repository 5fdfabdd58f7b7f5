"""The fsdp stage: FSDP2 on 2 processes trains like DDP while each rank holds 1/N of the
parameters; its sharded checkpoints resume at 1, 2 or 4 processes with the same losses; activation
checkpointing and CPU offload change memory, not results."""
import pickle
import shutil

import pytest

from conftest import TEN_STEPS, CreatesFile, run_stage, torchrun
from coursekit import KIT_ROOT, memory, presets, runs

pytestmark = pytest.mark.stages
FSDP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_fsdp.py"
DDP_SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"
STEPS = TEN_STEPS
TINY_PARAMETER_BYTES = 3_427_712 * 4  # fp32


@pytest.fixture(scope="module")
def fsdp_two(fsdp_ten_steps):
    """10 steps on 2 processes, checkpoints at 5 and 10 (conftest's, shared with export-hf)."""
    return fsdp_ten_steps


@pytest.fixture(scope="module")
def ddp_two(ddp_ten_steps):
    return runs.read_metrics(ddp_ten_steps)


def losses(metrics, keys=("loss", "val_loss")):
    """The listed losses of every step, in one flat list (None where a step has no validation)."""
    return [r.get(key) for r in metrics for key in keys]


def test_two_processes_train_like_ddp(fsdp_two, ddp_two):
    out, stdout = fsdp_two
    assert "2 processes, backend " in stdout and stdout.count("step 1/10 ") == 1
    fsdp = runs.read_metrics(out)
    assert [r["step"] for r in fsdp] == list(range(1, 11))
    for got, expected in zip(fsdp, ddp_two, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-4)
        assert got.get("val_loss", 0) == pytest.approx(expected.get("val_loss", 0), abs=1e-4)


def test_each_rank_holds_its_share_of_parameters_gradients_and_optimiser_state(fsdp_two):
    out, stdout = fsdp_two
    reports = runs.read_json(out / "memory.json")
    assert len(reports) == 2
    for rank, report in enumerate(reports):
        assert report["params"] == pytest.approx(TINY_PARAMETER_BYTES / 2, rel=0.05)
        assert report["grads"] == pytest.approx(report["params"], rel=1e-9)
        assert report["optimizer"] == pytest.approx(2 * report["params"], rel=0.01)  # Adam: m, v
        assert report["peak"] > report["params"] and report["peak_kind"] == "RSS"
        assert f"rank {rank} | params " in stdout


def test_measured_bytes_match_the_memory_arithmetic(fsdp_two):
    """coursekit.memory's prediction for FSDP on 2 ranks in fp32, against the tensors each rank
    really holds (FSDP pads a shard by at most a row per parameter)."""
    out, _ = fsdp_two
    tiny = memory.Model.from_preset(presets.get_preset("tiny"))
    predicted = memory.per_rank_bytes(tiny, "fsdp", world_size=2)
    for report in runs.read_json(out / "memory.json"):
        for part in ("params", "grads", "optimizer"):
            assert report[part] == pytest.approx(predicted[part], rel=0.01), part


def checkpoint_at_step_5(run_dir, copy):
    """A copy of the 2-process run as it was after step 5: its checkpoint and metrics."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "ckpt" / "step_00000010")
    runs.write_json_atomic(copy / "ckpt" / "latest.json", {"dir": "step_00000005", "step": 5})
    return copy


def shard_lost_at_step_10(run_dir, copy):
    """A copy of the 2-process run whose last checkpoint lost rank 1's shard, as a disk that
    filled up or a copy cut short leaves it."""
    shutil.copytree(run_dir, copy)
    (copy / "ckpt" / "step_00000010" / "__1_0.distcp").unlink()
    return copy


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_two_rank_checkpoint_resumes_at_another_world_size(fsdp_two, builtin_data, tmp_path,
                                                             nproc):
    """On 1 process, from a run whose newest checkpoint is broken: the resume names it in one
    warning and takes the one before (step 5), as on 4 from a run that stopped after step 5."""
    out, _ = fsdp_two
    copy = (shard_lost_at_step_10 if nproc == 1 else checkpoint_at_step_5)(out, tmp_path / "run")
    # 4 processes x micro-batch 2 x 32 tokens = the same 256-token minibatch (conftest.TEN_STEPS)
    split = ["--micro-batch", "2"] if nproc == 4 else []
    result = torchrun(nproc, FSDP_SCRIPT, *STEPS, *split, "--resume", "--data", builtin_data,
                      "--out", copy)
    assert f"{nproc} processes" in result.stdout
    assert f"resumed from {copy / 'ckpt' / 'step_00000005'} at step 5" in result.stdout
    if nproc == 1:
        assert f"warning: checkpoint {copy / 'ckpt' / 'step_00000010'} differs from its " \
               "manifest.json (__1_0.distcp: changed, added or removed" in result.stderr
    resumed, reference = runs.read_metrics(copy), runs.read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    # validation reads micro-batches of the run's own size: compare it at the same size only
    keys = ("loss", "val_loss") if not split else ("loss",)
    assert losses(resumed[5:], keys) == pytest.approx(losses(reference[5:], keys), abs=1e-5)
    reports = runs.read_json(copy / "memory.json")
    assert [r["params"] for r in reports] == \
           pytest.approx([TINY_PARAMETER_BYTES / nproc] * nproc, rel=0.05)


def test_a_checkpoint_pickle_written_by_someone_else_is_not_resumed_from(fsdp_two, builtin_data,
                                                                         tmp_path):
    """PyTorch's distributed checkpoint reads its .metadata with pickle, so a crafted one would
    run code at the resume. It no longer matches the checkpoint's manifest: the stage stops in one
    line before reading anything."""
    out, _ = fsdp_two
    copy = checkpoint_at_step_5(out, tmp_path / "run")
    marker = tmp_path / "the-attackers-code-ran"
    (copy / "ckpt" / "step_00000005" / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))
    result = run_stage("train_gpt2_fsdp.py", *STEPS, "--resume", "--data", builtin_data, "--out",
                       copy)
    assert result.returncode != 0 and not marker.exists(), result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"error: checkpoint {copy / 'ckpt' / 'step_00000005'} differs from its manifest.json "
        "(.metadata: changed, added or removed since it was written): no checkpoint of "
        f"{copy} can be resumed from")


def test_a_self_consistent_checkpoint_from_someone_else_runs_none_of_its_pickles(
        fsdp_two, builtin_data, tmp_path):
    """Issue 47, item 9: a checkpoint copied in from someone else, whose manifest they wrote to
    match (a hash list anyone can compute), its metadata a crafted pickle: the resume stops in
    one line, and nothing in it runs (coursekit.dcp_data)."""
    out, _ = fsdp_two
    copy = checkpoint_at_step_5(out, tmp_path / "run")
    checkpoint, marker = copy / "ckpt" / "step_00000005", tmp_path / "the-attackers-code-ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))
    runs.write_json_atomic(checkpoint / runs.MANIFEST, runs.file_hashes(checkpoint))
    result = run_stage("train_gpt2_fsdp.py", *STEPS, "--resume", "--data", builtin_data, "--out",
                       copy)
    assert result.returncode == 1 and not marker.exists(), result.stderr[-3000:]  # faults.run's
    assert result.stderr == ("error: a checkpoint's metadata asks for io.open, which a DCP "
                             "checkpoint of the kit does not hold: it is not loaded (was it "
                             "made by someone else?)\n")


SHORT = ["--preset", "tiny", "--max-steps", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def one_process(builtin_data, tmp_path_factory):
    """3 steps in one process without a launcher, ending with an 8-token sample: (run directory,
    CompletedProcess). The plain run the memory options are compared with."""
    out = tmp_path_factory.mktemp("fsdp1")
    result = run_stage("train_gpt2_fsdp.py", *SHORT, "--sample-tokens", "8",
                       "--data", builtin_data, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.parametrize("flag", ["--activation-checkpointing", "--cpu-offload"])
def test_memory_options_keep_the_losses(builtin_data, tmp_path, one_process, flag):
    plain, _ = one_process
    option = run_stage("train_gpt2_fsdp.py", *SHORT, "--sample-tokens", "0", flag,
                       "--data", builtin_data, "--out", tmp_path)
    assert option.returncode == 0, option.stderr[-3000:]
    assert losses(runs.read_metrics(tmp_path)) == \
           pytest.approx(losses(runs.read_metrics(plain)), abs=1e-6)


def test_one_process_needs_no_launcher(one_process):
    """A group of one: `python train_gpt2_fsdp.py` shards over a single rank, checkpoints with
    torch.distributed.checkpoint, and writes its sample on exit."""
    out, result = one_process
    assert "Warning" not in result.stderr, result.stderr  # no noise at exit
    assert (out / "ckpt" / "step_00000003" / ".metadata").is_file()
    assert (out / "sample.txt").read_text().strip()


def test_the_root_stays_gathered_from_forward_to_backward(tmp_path):
    """The blocks give their gathered parameters back after forward; the root (embeddings, final
    norm, the tied head used at both ends of the model) keeps them until backward, instead of
    gathering the largest matrix again (reference trainers' reshard_after_forward=False)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from coursekit import stages, training
    fsdp = stages.load("fsdp")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = fsdp.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
        model = fsdp.GPT(config)
        precision = training.prepare_device(torch.device("cpu"), "fp32")
        fsdp.apply_fsdp(model, init_device_mesh("cpu", (1,)), False, precision)
        # torch from 2.8 keeps the root gathered by itself; 2.6 and 2.7 (the stages' minimum is
        # 2.6) resharded it unless told, which the stage does: its setting, not torch's default
        assert model._get_fsdp_state()._auto_reshard_after_forward is False
        model(torch.zeros(1, 16, dtype=torch.long))
        assert not isinstance(model.lm_head.weight, DTensor)  # gathered: a plain tensor
        assert isinstance(model.transformer.h["0"].mlp.c_fc.weight, DTensor)  # sharded again
    finally:
        dist.destroy_process_group()
