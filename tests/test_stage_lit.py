"""The lit stage: Lightning runs the same model and data as std, on 2 CPU devices. That a run
killed between checkpoints resumes from its own checkpoint exactly where an uninterrupted run
would be, lesson 03 shows and asserts (its nbval run, tests/test_notebooks.py); under Slurm, the
lit job's tasks are its processes, Lightning starting none of its own (tests/test_slurm.py)."""
import json

import pytest

from conftest import ONE_THREAD, QUARTER_STEP, TWENTY_STEPS, kit_env, run_stage, torchrun
from coursekit import KIT_ROOT, runs, stages

pytestmark = pytest.mark.stages
SCRIPT = "train_gpt2_lit.py"
FSDP_CHECK = KIT_ROOT / "tests" / "helpers" / "lit_fsdp_check.py"
STEPS = TWENTY_STEPS  # on the CPU even where a GPU is present: 2 devices, one machine


def run_lit(*args, **kwargs):
    result = run_stage(SCRIPT, *args, env=kit_env(ONE_THREAD), **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def std_metrics(std_twenty_steps):
    return runs.read_metrics(std_twenty_steps)


@pytest.fixture(scope="module")
def two_device_run(builtin_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lit20")
    result = run_lit(*STEPS, "--devices", "2", "--data", builtin_data, "--out", out)
    return out, result.stdout


def test_two_devices_follow_std_at_the_same_global_batch(two_device_run, std_metrics):
    out, stdout = two_device_run
    assert "2 process(es) | DDPStrategy\ndevice cpu" in stdout
    assert stdout.count("step 1/20 ") == 1  # only global rank 0 prints
    config = runs.read_json(out / "config.json")
    assert (config["stage"], config["world_size"], config["grad_accum"]) == ("lit", 2, 1)
    metrics = runs.read_metrics(out)
    for rank in (0, 1):  # each rank's own step records (coursekit.watchdog)
        records = (out / "ranks" / f"{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in records] == list(range(1, 21))
    assert [r["step"] for r in metrics] == list(range(1, 21))
    for lit, std in zip(metrics, std_metrics, strict=True):
        assert lit["loss"] == pytest.approx(std["loss"], abs=1e-4)
        assert lit["lr"] == pytest.approx(std["lr"], rel=1e-9)
    assert [r["step"] for r in metrics if "val_loss" in r] == [10, 20]
    assert metrics[-1]["val_loss"] == pytest.approx(std_metrics[-1]["val_loss"], abs=1e-4)
    assert (out / "ckpt" / "last.ckpt").resolve().name == "step_00000020.ckpt"


def test_one_device_has_the_std_first_loss(builtin_data, tmp_path, std_metrics):
    run_lit(*STEPS[:2], *QUARTER_STEP, "--max-steps", "1", "--sample-tokens", "0", "--device",
            "cpu", "--data", builtin_data, "--out", tmp_path)
    assert runs.read_metrics(tmp_path)[0]["loss"] == pytest.approx(std_metrics[0]["loss"], abs=1e-5)


# --- bad choices: one line naming the value and what is allowed -------------------------------
BAD_CHOICES = [
    (["--strategy", "deepspeed_stage_2"], "--strategy deepspeed_stage_2 runs on CUDA GPUs only"),
    (["--devices", "0"], "argument --devices: expected a positive integer, got 0"),
    (["--strategy", "horovod"], "argument --strategy: invalid choice: 'horovod'"),
    (["--devices", "3"], "--batch-tokens 1024 is not a multiple of micro-batch x seq-len x "
                         "data-parallel processes = 4 x 128 x 3"),
]


def parse_error(capsys, *args):
    """(exit status, stderr) of the script's own argument parsing, in this process: the first
    thing main() does, before Lightning starts anything."""
    lit = stages.load("lit")  # here, not at collection: importing Lightning takes seconds
    with pytest.raises(SystemExit) as stopped:
        lit.parse_args(list(map(str, args)))
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", BAD_CHOICES,
                         ids=["deepspeed", "devices-0", "strategy", "indivisible"])
def test_bad_choices_get_one_line(builtin_data, tmp_path, capsys, args, message):
    status, stderr = parse_error(capsys, "--preset", "tiny", "--device", "cpu", "--data",
                                 builtin_data, "--out", tmp_path, *args)
    assert status == 2
    assert message in stderr and stderr.strip().count("\n") == 0, stderr


def test_a_strategy_lightning_refuses_stops_the_script_with_one_line(builtin_data, tmp_path):
    """Lightning itself refuses FSDP without a GPU, when main() builds the Trainer: the script
    turns that into one line, as a whole process."""
    result = run_stage(SCRIPT, "--preset", "tiny", "--device", "cpu", "--strategy", "fsdp",
                       "--devices", "2", "--data", builtin_data, "--out", tmp_path)
    assert result.returncode != 0
    assert "--strategy fsdp --devices 2: The strategy `fsdp` requires a GPU" in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr


def test_existing_run_is_not_overwritten_without_resume(two_device_run, builtin_data, capsys):
    out, _ = two_device_run
    status, stderr = parse_error(capsys, "--preset", "tiny", "--data", builtin_data, "--out", out)
    assert status == 2
    assert f"{out} already holds a checkpoint: pass --resume" in stderr


# --- sharded strategies ----------------------------------------------------------------------
def test_under_fsdp_weight_decay_and_the_gradient_norm_cover_every_shard():
    """Lightning's FSDP hands configure_optimizers each rank's flattened 1-D shards: grouped by
    dimension, no weight would decay. Grouped by the names taken before wrapping, the decayed
    shards of the 2 ranks add up to the whole model's matrices; the gradient norm adds up the
    shards' squares (one rank's alone is about 1/sqrt(2) of it)."""
    result = torchrun(2, FSDP_CHECK, env=kit_env(ONE_THREAD))
    check = json.loads(result.stdout.strip().splitlines()[-1])
    assert check["sharded_by_dimension"] == 0  # the problem the names solve
    assert check["sharded_decayed"] == check["whole_decayed"] > 0
    assert check["sharded_norm"] == pytest.approx(check["whole_norm"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_1", "deepspeed_stage_2",
                                      "deepspeed_stage_3"])
def test_sharded_strategies_train_on_every_gpu_with_the_ddp_gradient_norm(builtin_data, tmp_path,
                                                                          strategy):
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: on 1, nothing is sharded")
    runs_by = {}
    for name in ("ddp", strategy):
        out = tmp_path / name
        run_lit(*STEPS[:2], "--max-steps", "3", "--sample-tokens", "0", "--strategy", name,
                "--data", builtin_data, "--out", out)
        runs_by[name] = runs.read_metrics(out)
    for reference, sharded in zip(runs_by["ddp"], runs_by[strategy], strict=True):
        assert sharded["loss"] == pytest.approx(reference["loss"], rel=0.02)
        assert sharded["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)
