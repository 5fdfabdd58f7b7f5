"""The one distributed set-up every multi-process stage shares (coursekit.distributed): which
device each local rank gets, the torch it needs, and the one-line errors when neither fits."""
import subprocess
import sys

import pytest
import torch

from conftest import kit_env, torchrun
from coursekit import KIT_ROOT, KitError, distributed, envcheck, faults

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("visible, requested, devices", [
    ({"cuda": 4}, "auto", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),  # one GPU per local rank
    ({"cuda": 2}, "cuda", ["cuda:0", "cuda:1"]),
    ({"cuda": 0, "xpu": 2}, "auto", ["xpu:0", "xpu:1"]),  # Intel GPUs when there is no CUDA
    ({"cuda": 2, "xpu": 2}, "xpu", ["xpu:0", "xpu:1"]),  # a kind asked for by name wins
    ({"cuda": 4}, "cpu", ["cpu", "cpu", "cpu"]),
    ({"cuda": 0}, "auto", ["cpu", "cpu"]),  # a laptop: every process on the CPU
    ({"cuda": 1}, "cuda", ["cuda:0"] * 4),  # a site that shows each task its own GPU only
])
def test_each_local_rank_gets_its_own_device(visible, requested, devices):
    assert [str(distributed.device_for(rank, requested, visible))
            for rank in range(len(devices))] == devices


def test_a_local_rank_beyond_the_visible_gpus_is_refused():
    with pytest.raises(KitError, match=r"^local rank 2 has no cuda device of its own: this "
                                       r"process sees 2; start at most 2 processes per node"):
        distributed.device_for(2, "auto", {"cuda": 2})


@pytest.mark.parametrize("kind, name", [("cuda", "CUDA/ROCm GPU"), ("xpu", "Intel GPU")])
def test_a_device_that_is_not_there_is_refused(kind, name):
    with pytest.raises(KitError, match=rf"^--device {kind}: no {name} is visible to this process"):
        distributed.device_for(0, kind, {"cuda": 0})


def test_a_stage_asked_for_cuda_without_one_says_so_in_one_line(builtin_data, tmp_path):
    """CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too."""
    result = subprocess.run(
        [sys.executable, KIT_ROOT / "solutions" / "train_gpt2_ddp.py", "--device", "cuda",
         "--data", builtin_data, "--out", tmp_path / "run"],
        capture_output=True, text=True, timeout=120, env=kit_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("train_gpt2_ddp.py: error: --device cuda: no CUDA/ROCm GPU is "
                             "visible to this process (use --device auto or cpu)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("version, new_enough", [
    ("2.5.1+cu124", False), ("1.13.1", False), ("2.6.0", True), ("2.13.0+cpu", True),
    ("3.0.0a0+git1234", True)])
def test_the_torch_version_is_checked(version, new_enough):
    assert (distributed.torch_version(version) >= distributed.MIN_TORCH) is new_enough
    if new_enough:
        distributed.check_torch(version)
    else:
        assert faults.run(lambda: distributed.check_torch(version)) == (
            f"error: torch {version} is too old: the course's stages need torch >= 2.6 (pip "
            "install 'torch>=2.6', or load a newer module)")


def test_envcheck_says_which_torch_the_stages_need(tmp_path):
    info = envcheck.collect(root=tmp_path)
    assert info["torch_new_enough"] is True
    assert f"{torch.__version__} (CUDA " in envcheck.report(info)
    assert "the stages need >= 2.6)" in envcheck.report(info)


@pytest.mark.gpu
def test_every_process_lands_on_its_own_gpu():
    """Under torchrun with --device cuda, each rank's current device is its local rank's GPU,
    set before NCCL's group started (the ranks' device indices, gathered over NCCL)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs to tell one rank's from another's; this node has 1")
    result = torchrun(2, KIT_ROOT / "tests" / "helpers" / "device_check.py")
    assert result.stdout.strip().splitlines()[-1] == "[0, 1]"


def test_a_torch_whose_schedules_keep_every_microbatchs_logits_is_refused_for_pp():
    class OldSchedule:  # the step() of torch 2.6's pipeline schedules, and no eval()
        def step(self, *args, target=None, losses=None, **kwargs):
            pass

    with pytest.raises(KitError, match=r"pipeline schedules have no step\(return_outputs=False\)"
                                       r" or eval\(\).*: the pp stage needs a newer torch"):
        distributed.check_pipeline_schedules(OldSchedule)
    distributed.check_pipeline_schedules()  # this torch's have both
