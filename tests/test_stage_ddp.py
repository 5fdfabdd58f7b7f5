"""The ddp stage: DDP gradients equal single-process ones; 2 processes follow the std run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kit_env, run_stage
from coursekit import KIT_ROOT, runs

pytestmark = pytest.mark.stages
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = ["--preset", "tiny", "--max-steps", "20", "--eval-interval", "10", "--sample-tokens", "0"]


def torchrun(nproc, script, *args):
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", str(script), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=kit_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_ddp_gradient_equals_the_single_process_gradient():
    result = torchrun(2, KIT_ROOT / "tests" / "helpers" / "ddp_gradient_check.py",
                      KIT_ROOT / "solutions" / "train_gpt2_ddp.py")
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


def test_two_processes_follow_std_at_the_same_global_batch(builtin_data, tmp_path, std_metrics):
    result = torchrun(2, KIT_ROOT / "solutions" / "train_gpt2_ddp.py", *STEPS,
                      "--data", builtin_data, "--out", tmp_path)
    assert "2 process(es) | gloo backend" in result.stdout
    assert "grad_accum = 1 | processes = 2" in result.stdout
    assert result.stdout.count("step 1/20 ") == 1  # only rank 0 prints
    ddp_metrics = runs.read_metrics(tmp_path)
    assert [r["step"] for r in ddp_metrics] == list(range(1, 21))
    for ddp, std in zip(ddp_metrics, std_metrics, strict=True):
        assert ddp["loss"] == pytest.approx(std["loss"], abs=1e-4)
        assert ddp.get("val_loss", 0) == pytest.approx(std.get("val_loss", 0), abs=1e-4)
    assert runs.load_checkpoint(tmp_path)[0] == 20


def test_one_process_without_torchrun_is_the_std_run(builtin_data, tmp_path, std_metrics):
    result = run_stage("train_gpt2_ddp.py", *STEPS, "--data", builtin_data, "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1 process(es) | gloo backend" in result.stdout
    assert [r["loss"] for r in runs.read_metrics(tmp_path)] == \
           pytest.approx([r["loss"] for r in std_metrics], abs=1e-6)
