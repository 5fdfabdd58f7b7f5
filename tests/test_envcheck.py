"""What envcheck reports, checked against other witnesses of the same facts: the package
metadata, coreutils' nproc, the NVIDIA driver, a PATH the test lays out, tiktoken itself."""
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
import torch

from coursekit import envcheck, images, instruct

pytestmark = pytest.mark.unit
TOKENIZER_FILES = ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee",  # tiktoken's cache names of
                   "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")  # vocab.bpe and encoder.json


def envcheck_json(env=None):
    """`python -m coursekit envcheck --json` in a fresh process, parsed."""
    result = subprocess.run([sys.executable, "-m", "coursekit", "envcheck", "--json"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def nproc(*args):
    """coreutils' count of processors; it also obeys OMP_NUM_THREADS, so that is left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    return int(subprocess.run(["nproc", *args], capture_output=True, text=True, env=env,
                              check=True).stdout)


def gpus_the_driver_lists():
    """GPU names from nvidia-smi, the driver's own view; none where there is no NVIDIA driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout
    return [name.strip() for name in listed.splitlines() if name.strip()]


def test_versions_and_cores_are_the_platforms(tmp_path):
    info = envcheck.collect(root=tmp_path)
    assert info["python"] == platform.python_version()
    assert info["torch"] == metadata.version("torch")
    assert info["cpu_cores"] == nproc() and info["machine_cores"] == nproc("--all")


def test_cores_are_those_the_process_may_use(tmp_path):
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # as `taskset` or a Slurm allocation would
    try:
        pinned = envcheck.collect(root=tmp_path)
    finally:
        os.sched_setaffinity(0, allowed)
    assert pinned["cpu_cores"] == 1 and pinned["machine_cores"] == nproc("--all")


def test_slurm_commands_are_those_on_the_path(tmp_path, monkeypatch):
    for command in ("sbatch", "squeue"):
        (tmp_path / command).write_text("#!/bin/sh\n")
        (tmp_path / command).chmod(stat.S_IRWXU)
    (tmp_path / "srun").write_text("not executable\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    info = envcheck.collect(root=tmp_path)
    assert info["slurm_commands"] == {"sbatch": True, "srun": False, "squeue": True,
                                      "sinfo": False, "scontrol": False}
    assert "slurm commands    sbatch, squeue (inside job 4242)" in envcheck.report(info)


def test_a_launcher_of_another_python_on_the_path_is_a_problem(tmp_path, monkeypatch):
    """Issue 48, item 11: a site module's torchrun first on PATH starts that module's Python,
    whose workers cannot import the kit; the course environment's own is fine."""
    module, venv = tmp_path / "module", tmp_path / "venv"
    for folder, python in ((module, "/appl/pytorch/2.6/bin/python3"), (venv, sys.executable)):
        folder.mkdir()
        for name in envcheck.LAUNCHERS:
            (folder / name).write_text(f"#!{python}\nimport sys\n")
            (folder / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{module}:{venv}")
    report = envcheck.report(envcheck.collect(root=tmp_path))
    assert (f"torchrun          {module}/torchrun: PROBLEM: it runs /appl/pytorch/2.6/bin/python3, "
            f"not this one ({sys.executable})") in report
    assert "use python -m torch.distributed.run" in report
    monkeypatch.setenv("PATH", f"{venv}:{module}")
    report = envcheck.report(envcheck.collect(root=tmp_path))
    assert f"accelerate        {venv}/accelerate: this Python's" in report
    assert "PROBLEM" not in report.split("gpt-2 tokenizer")[1]


def test_the_hugging_face_cache_and_the_disk_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = envcheck.collect(root=tmp_path)
    files, free = info["free_here"]
    assert files > 0 and free > 0
    report = envcheck.report(info)
    assert f"hugging face      cache {tmp_path / 'hf'} (HF_HOME); offline: yes" in report
    assert re.search(r"^kit's disk        [\d,.]+ GB and [\d,]+ files free", report, re.M)


def tiktoken_loads_offline(cache_dir):
    """Whether tiktoken itself loads GPT-2 from ``cache_dir`` when every download is refused
    (through a proxy where nothing listens)."""
    nowhere = "http://127.0.0.1:9"
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache_dir), "HTTPS_PROXY": nowhere,
           "https_proxy": nowhere, "HTTP_PROXY": nowhere, "http_proxy": nowhere, "NO_PROXY": "",
           "no_proxy": ""}
    return subprocess.run([sys.executable, "-c", "import tiktoken; tiktoken.get_encoding('gpt2')"],
                          env=env, capture_output=True, timeout=120).returncode == 0


def test_tokenizer_offline_is_whether_tiktoken_loads_without_the_network(tmp_path, monkeypatch):
    from coursekit import data
    cache = tmp_path / "tiktoken"
    shutil.copytree(data.tiktoken_cache_dir(), cache)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert envcheck.collect(tmp_path)["tokenizer_offline"] is True
    assert tiktoken_loads_offline(cache)
    vocabulary = cache / TOKENIZER_FILES[0]
    vocabulary.write_bytes(vocabulary.read_bytes()[:-1] + b"x")  # one byte changed
    assert envcheck.collect(tmp_path)["tokenizer_offline"] is False
    assert not tiktoken_loads_offline(cache)


def test_prepared_data_is_found(builtin_data, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "builtin").symlink_to(builtin_data)
    (tmp_path / "data" / "empty").mkdir()  # no meta.json: not prepared data
    found = envcheck.prepared_data(tmp_path)
    assert list(found) == [str(tmp_path / "data" / "builtin")]
    tokens = {split: sum(len(np.load(shard, mmap_mode="r"))
                         for shard in builtin_data.glob(f"{split}_*.npy"))
              for split in ("train", "val")}
    report = envcheck.report(envcheck.collect(tmp_path))
    assert (f"prepared data     {tmp_path / 'data' / 'builtin'}: builtin, "
            f"val {tokens['val']:,} tokens, train {tokens['train']:,} tokens") in report


def test_an_instruction_set_is_reported_in_examples(tmp_path):
    directory = tmp_path / "data" / "instruct"
    instruct.prepare(directory)
    lines = {split: len((directory / f"{split}.jsonl").read_text().splitlines())
             for split in ("train", "val")}
    report = envcheck.report(envcheck.collect(tmp_path))
    assert (f"{directory}: kit-tasks, train {lines['train']:,} examples, "
            f"val {lines['val']:,} examples") in report


def test_an_image_set_is_reported_in_images(tmp_path):
    directory = tmp_path / "data" / "shapes"
    images.prepare(directory, count=60, workers=1, files=True)
    files = {split: len(list((directory / "files" / split).rglob("*.jpg")))
             for split in ("train", "val")}
    report = envcheck.report(envcheck.collect(tmp_path))
    assert (f"{directory}: shapes, train {files['train']:,} images, "
            f"val {files['val']:,} images") in report


def test_cli_report_and_json():
    text = subprocess.run([sys.executable, "-m", "coursekit", "envcheck"], capture_output=True,
                          text=True, check=True).stdout
    for label in ("python", "torch", "cpu cores", "device", "slurm commands", "prepared data",
                  "gpt-2 tokenizer"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    info = envcheck_json({k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    assert info["cpu_cores"] == nproc() and info["torch"] == metadata.version("torch")
    cuda = [name for kind, _, name in info["devices"] if kind == "cuda"]
    # every GPU the driver lists, unless this torch is a CPU-only build; then the CPU
    assert cuda == (gpus_the_driver_lists() if torch.version.cuda else [])
    assert info["devices"][-1][0] == "cpu"


@pytest.mark.parametrize("env, given", [
    ({}, None), ({"CUDA_VISIBLE_DEVICES": ""}, None), ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"SLURM_GPUS_ON_NODE": "0"}, None), ({"ROCR_VISIBLE_DEVICES": "NoDevFiles"}, None),
    ({"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES=0"),  # a mask that names GPU 0
    ({"ROCR_VISIBLE_DEVICES": "3"}, "ROCR_VISIBLE_DEVICES=3"),  # LUMI's select_gpu
])
def test_the_gpus_a_job_was_given_are_read_from_slurm_and_the_masks(env, given):
    assert envcheck.gpus_given(env) == given


def test_gpus_given_that_torch_cannot_see_fail_envcheck_in_one_line():
    """Slurm gave the job 4 GPUs; this torch sees none (a CPU build here, hidden GPUs on a GPU
    node): the PyPI torch that make setup installs over a site's own would train on the CPU."""
    env = {**os.environ, "SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "coursekit", "envcheck"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: the job was given GPUs (SLURM_GPUS_ON_NODE=4) but "
                                    f"torch {torch.__version__} sees none")
    assert "use the site's PyTorch module" in result.stderr
    assert "PROBLEM: the job was given GPUs" in result.stdout  # the report says it too


@pytest.mark.gpu
def test_this_torch_was_built_for_every_gpu_it_sees():
    info = envcheck_json()
    assert info["gpu_problem"] is None and info["capabilities"] and info["arch_list"]
