"""The batch files on a real Slurm cluster (tests/slurm/cluster-up.sh). The ci site's files pass
`sbatch --test-only`, and run to exit 0 with their loss lines on a 2-node cluster, each stage on
its widest shape and ddp on every one (the other files share their text); the 2-node jobs really
use both nodes; a job stopped mid-run is requeued, resumes from its checkpoint and ends where an
uninterrupted run does, and so does a 2-node job whose second node dies; a process that crashes is
started again with its group, in the same job. Every real site's files pass `sbatch --test-only` on
a copy of that site's partition (its name and time limit; nodes of its cores, GPUs and memory),
which refuses what the site would refuse for those reasons. Accounts and QoS are not checked: the
test cluster keeps no accounting (slurmdbd and a database), and the profiles' accounts are
placeholders an instructor fills in."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from conftest import (debian_tool, held_pythonpath, http_get, made_in_kit, one_ray_at_a_time,
                      owner_login)
from coursekit import KIT_ROOT, data, images, runs, slurm, widgets

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
CI = slurm.load_site("ci")
CI_FILES = sorted(p.name for p in (KIT_ROOT / "batchfiles" / "ci").glob("*.sh"))
TRAINING_FILES = [name for name in CI_FILES
                  if name not in slurm.CPU_JOBS
                  and not name.startswith(("batch-lora", "batch-hpo", "batch-selftest", "batch-ray",
                                          "batch-lab"))]
LORA_FILES = [name for name in CI_FILES if name.startswith("batch-lora")]
# Slurm runs every launch once, not every file, each on as few processes as show it: std on 1;
# ddp on 1 node x 2 (the reference, and the requeue tests' file) and, started by srun, on 2 x 1;
# tp on 2 x 2 (a tensor-parallel pair on each node, data parallel across them: the 2 x 2 shape,
# whose file is ddp's with --tp added); fsdp, pp, lit and resnet across 2 nodes x 1; lora on 1 node x 2
# (the requeue test's) and 2 x 1. Every other file is the text of one of these with other
# numbers and stage flags (test_every_file_has_the_text_of_a_file_slurm_runs), and passes
# `sbatch --test-only`.
TRAINING_RUNS = ["batch-std-1n1g.sh", "batch-ddp-1n2g.sh", "batch-tp-2n2g.sh",
                 "batch-fsdp-2n1g.sh", "batch-pp-2n1g.sh", "batch-lit-2n1g.sh",
                 "batch-resnet-2n1g.sh"]
GPT_RUNS = [name for name in TRAINING_RUNS if "resnet" not in name]
LORA_RUNS = ["batch-lora-1n2g.sh", "batch-lora-2n1g.sh"]
# Across the 2 nodes lora runs DeepSpeed ZeRO-3 (the config chosen at submission, as the batch
# files say), whose multi-node start is its own (deepspeed_multinode_launcher); 1n2g runs DDP
LORA_CONFIGS = {"batch-lora-2n1g.sh": "zero3"}
HPO_FILES = [name for name in CI_FILES if name.startswith("batch-hpo")]
HPO_TRIALS = int(re.search(r"--trials (\d+)", CI["hpo_args"]).group(1))
LORA_STEPS = int(re.search(r"--max-steps (\d+)", CI["finetune_args"]).group(1))
# The ddp stage started by srun, one task per process (the launcher of sites that bind each task
# to its cores, such as LUMI), generated into the test's folder: 2 nodes x 1 task
SRUN_LAUNCHED = "batch-ddp-2n1g-srun.sh"
# The self-test across 2 nodes, 1 process each, of the stages it starts in two ways across nodes
# (the committed 2n2g file with smaller numbers):
# generated into the test's folder as well
SELFTEST_ACROSS_NODES = "batch-selftest-2n1g.sh"
# The images job, writing into the test's folder rather than over data/shapes
IMAGES_AGAIN = "batch-images-again.sh"
# A Ray cluster across 2 nodes, 1 process each (the committed 2n2g file with smaller numbers)
RAY_ACROSS_NODES = "batch-ray-2n1g.sh"
# The std job of a profile whose set-up activates a virtual environment that is not there (lesson
# 10's job that dies at once)
NO_ENVIRONMENT = "batch-std-1n1g-no-env.sh"
STEPS = int(re.search(r"--max-steps (\d+)", CI["train_args"]).group(1))
SITES = [site for site in slurm.site_names() if site != "ci"]
# Job states Slurm keeps for MinJobAge (300 s) once a job has ended: a poll cannot miss them
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def site_partition(profile):
    """The partition a site's GPU jobs land in: the one they name, or the site's default."""
    return profile["partition"] or profile["name"]


def site_copy_lines(profile):
    """cluster-up.sh's lines "site partition node_set cores gpus memory max_time max_nodes" for
    a copy of a site's partitions: its GPU partition; those it puts shapes in, which take jobs of
    their shapes' nodes at most; its test partition, up to the self-test's time; its CPU
    partition, on nodes without GPUs."""
    shape = f"{profile['cpus_per_node']} {profile['gpus_per_node']} {profile['memory_per_node']}"
    lines = [f"{site_partition(profile)} gpu {shape} {profile['max_time']} UNLIMITED"]
    for partition in dict.fromkeys(profile["shape_partitions"].values()):
        nodes = max(int(name.split("n")[0]) for name, where in profile["shape_partitions"].items()
                    if where == partition)
        lines.append(f"{partition} gpu {shape} {profile['max_time']} {nodes}")
    if profile["test_partition"]:
        lines.append(f"{profile['test_partition']} gpu {shape} {profile['test_time']} UNLIMITED")
    if profile["cpu_partition"]:
        lines.append(f"{profile['cpu_partition']} cpu {profile['cpus_per_node']} 0 "
                     f"{profile['memory_per_node']} {profile['max_time']} UNLIMITED")
    return [f"{profile['name']} {line}" for line in lines]


def cluster_shapes(profiles):
    """What cluster-up.sh builds: the debug nodes as ci describes them, and a copy of the
    partitions of each of ``profiles``."""
    return {"SLURM_CI_CPUS": str(CI["cpus_per_node"]),
            "SLURM_CI_MEM_MB": str(CI["memory_per_node"]),
            "SLURM_CI_MAX_TIME": CI["max_time"],
            "SLURM_CI_SITES": "\n".join(line for p in profiles for line in site_copy_lines(p))}


#: A site that splits its jobs (issue 48, item 2), written as a new centre would from the generic
#: profile: GPU jobs of 1 or 2 GPUs in gpusmall, which takes one node at most, larger ones in
#: gpumedium, where a job gets at most 4 GPUs (2n2g, not 2n4g); the self-test in gputest, for 15
#: minutes at most; the jobs without GPUs in small, whose nodes are another architecture, with
#: an environment of their own.
SPLIT_EDITS = [("partition: gpu\n", "partition: gpumedium\n"),
               ('test_partition: ""', "test_partition: gputest"),
               ('test_time: "02:00:00"', 'test_time: "00:15:00"'),
               ('cpu_partition: ""', "cpu_partition: small"),
               ("cpu_setup: []", "cpu_setup: [module load python-data, source .venv-x86/bin/activate]"),
               ("shape_partitions: {}", "shape_partitions: {1n1g: gpusmall, 1n2g: gpusmall}"),
               ("topologies: [1n1g, 1n2g, 1n4g, 2n4g]", "topologies: [1n1g, 1n2g, 1n4g, 2n2g]")]


@pytest.fixture(scope="session")
def split_site(tmp_path_factory):
    """A kit root holding the split site's profile ("split"): (root, profile)."""
    root = tmp_path_factory.mktemp("split-site")
    text = (KIT_ROOT / "batchfiles" / "sites" / "generic.yml").read_text()
    for old, new in SPLIT_EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (root / "batchfiles" / "sites").mkdir(parents=True)
    (root / "batchfiles" / "sites" / "split.yml").write_text(text)
    shutil.copytree(KIT_ROOT / "solutions", root / "solutions")
    return root, slurm.load_site("split", root)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, split_site):
    """A Slurm cluster of 2 nodes on this machine, up for the session, stopped by PID after it."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root: it starts munged, slurmctld and slurmd")
    # installed here, where the other tests' installs wait for each other (conftest.apt_install)
    debian_tool("slurmctld", "slurmctld", "slurmd", "slurm-client", "munge")
    directory = tmp_path_factory.mktemp("slurm-ci")
    profiles = [slurm.load_site(site) for site in SITES] + [split_site[1]]
    env = {**os.environ, "SLURM_CI_DIR": str(directory), **cluster_shapes(profiles)}
    up = subprocess.run(["bash", str(KIT_ROOT / "tests" / "slurm" / "cluster-up.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    yield {**env, "SLURM_CONF": str(directory / "slurm.conf"), "logs": directory}
    subprocess.run(["bash", str(KIT_ROOT / "tests" / "slurm" / "cluster-down.sh")], env=env,
                   timeout=120)


@pytest.fixture(scope="session")
def builtin_in_kit():
    """The ci profile trains on data/builtin of the kit, as `make book` prepares it."""
    if not (KIT_ROOT / "data" / "builtin" / "meta.json").exists():
        data.prepare_builtin(KIT_ROOT / "data" / "builtin", progress=False)


@pytest.fixture(scope="session")
def shapes_in_kit():
    """The ci profile's resnet jobs train on data/shapes, as lesson 08 prepares it."""
    if not (KIT_ROOT / CI["images"] / "meta.json").exists():
        images.prepare(KIT_ROOT / CI["images"], workers=1, files=True)


def slurm_env(cluster, conf=None):
    """The environment of a Slurm command: the test cluster's, or that of a site's copy."""
    env = {name: value for name, value in cluster.items() if name != "logs"}
    return {**env, "SLURM_CONF": str(conf)} if conf else env


def run_dir(name):
    stage, topology, launcher = re.match(r"batch-(\w+)-(\d+n\d+g)(-srun)?\.sh", name).groups()
    return KIT_ROOT / "runs" / f"ci{launcher or ''}-{stage}-{topology}"


def study_dir(name):
    return KIT_ROOT / "runs" / f"ci-{name.removeprefix('batch-').removesuffix('.sh')}"


def batch_file(cluster, name):
    if name in (SRUN_LAUNCHED, SELFTEST_ACROSS_NODES, IMAGES_AGAIN, RAY_ACROSS_NODES,
                NO_ENVIRONMENT):
        return cluster["logs"] / name
    return KIT_ROOT / "batchfiles" / "ci" / name


def write_srun_launched(cluster):
    profile = {**slurm.load_site("ci"), "launcher": "srun", "name": "ci-srun"}
    batch_file(cluster, SRUN_LAUNCHED).write_text(
        slurm.training_job("ddp", slurm.Topology(2, 1), profile))


def submit(cluster, name, *options, log="{name}.%j.out", args=()):
    """sbatch a batch file from the kit's root, its log in the test's folder, with ``args`` for
    the batch file; the job id."""
    command = ["sbatch", "--parsable", f"--output={cluster['logs']}/{log.format(name=name)}",
               *options, str(batch_file(cluster, name)), *args]
    return subprocess.run(command, cwd=KIT_ROOT, env=slurm_env(cluster), capture_output=True,
                          text=True, check=True).stdout.split(";")[0].strip()


#: Seconds between two questions to slurmctld (scontrol, squeue) while a test waits for a job: each
#: costs about 6 ms of CPU, its own and slurmctld's (0.6 CPU-s per 100 on this machine), and the
#: Slurm tests wait with up to three jobs at once for 15 minutes. A log file is read more often.
SLURM_POLL_S = 1.0


def wait_until(condition, timeout, what, every=0.2):
    """Poll a condition that stays true once it is (a line in a log, a job that has ended), every
    ``every`` seconds: how often decides only how soon the test goes on, never whether it
    passes."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(every)
    return result


def wait_for_job(cluster, job_id, timeout=900):
    """Wait until the job (every task of an array) has ended: (exit status, as `sbatch --wait`
    gives it, and `scontrol -d show job` as it ended). `sbatch --wait` itself looks at 2, 10, 42,
    74, ... s, which kept each test waiting up to half a minute after its job had ended."""
    def ended():
        record = scontrol(cluster, "-d", "show", "job", job_id)
        states = re.findall(r"\bJobState=(\w+)", record)
        return record if states and all(state in ENDED for state in states) else None

    record = wait_until(ended, timeout, f"job {job_id} did not end", every=SLURM_POLL_S)
    exits = re.findall(r"\bExitCode=(\d+):(\d+)", record)  # status:signal of each task
    return max(int(status) if signal == "0" else 1 for status, signal in exits), record


def job_state(cluster, job_id):
    return re.search(r"JobState=(\w+)", scontrol(cluster, "show", "job", job_id)).group(1)


def scontrol(cluster, *args):
    return subprocess.run(["scontrol", *args], env=slurm_env(cluster), capture_output=True,
                          text=True, check=True).stdout


def wanted_by(session, fixture, names):
    """Those of `names` that the session's selected tests using `fixture` will ask for: a test's
    own (its "name" parameter), or all of them for a test without one."""
    wanted = set()
    for item in session.items:
        if fixture in getattr(item, "fixturenames", ()):
            own = item.callspec.params.get("name") if hasattr(item, "callspec") else None
            wanted |= {own} & set(names) if own else set(names)
    return [name for name in names if name in wanted]


class Jobs:
    """Batch jobs run once a session, each when a test first asks for its result. The first ask
    submits every job the session's selected tests will want, so that Slurm runs them side by side
    as its nodes allow; each test then waits for its own job only."""

    def __init__(self, cluster, wanted, options=None):
        self.cluster, self.wanted, self.ids, self.results = cluster, wanted, {}, {}
        self.options = options or {}  # {name: sbatch options of that job}

    def result(self, name):
        if name not in self.results:
            for job in (name, *self.wanted):
                if job not in self.ids:
                    shutil.rmtree(self.folder(job), ignore_errors=True)
                    self.ids[job] = self.submit(job)
            status, record = wait_for_job(self.cluster, self.ids[name])
            self.results[name] = self.read(name, self.ids[name], status, record)
        return self.results[name]

    def clean(self):
        for name in self.ids:
            shutil.rmtree(self.folder(name), ignore_errors=True)

    folder = staticmethod(run_dir)

    def submit(self, name):
        return submit(self.cluster, name, *self.options.get(name, ()))

    def read(self, name, job_id, status, record):
        """(exit status, log, metrics, `scontrol -d show job` as it ended, the run's config and
        the files it saved): read as the job ends, since a requeue test runs the same file into
        the same folder again, whenever it comes"""
        log = (self.cluster["logs"] / f"{name}.{job_id}.out").read_text()
        folder = run_dir(name)
        config = folder / "config.json"
        saved = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
        return (status, log, runs.read_metrics(folder), record,
                runs.read_json(config) if config.exists() else None, saved)


@pytest.fixture(scope="session")
def training(request, cluster, builtin_in_kit, shapes_in_kit):
    """The training jobs Slurm runs and the srun-launched ddp job, each run once, as the tests
    ask."""
    write_srun_launched(cluster)
    jobs = Jobs(cluster, wanted_by(request.session, "training", [*TRAINING_RUNS, SRUN_LAUNCHED]))
    yield jobs
    jobs.clean()


@pytest.mark.parametrize("name", CI_FILES)
def test_batch_file_passes_sbatch_test_only(cluster, name):
    result = sbatch_test_only(cluster, KIT_ROOT / "batchfiles" / "ci" / name)
    assert result.returncode == 0 and "to start at" in result.stderr, result.stderr


def launch_text(name):
    """A ci batch file's text with what differs between stages and shapes blanked: the job's
    name, the training script with its flags, the Accelerate config (one process, or DDP), the
    stage's name, and every number."""
    text = (KIT_ROOT / "batchfiles" / "ci" / name).read_text()
    text = re.sub(r"--job-name=\S+", "--job-name=NAME", text)
    text = re.sub(r"solutions/\w+\.py[^&']*", "SCRIPT ", text)  # up to the `&` or closing quote
    text = re.sub(r"solutions/accelerate/\w+\.yaml", "CONFIG", text)
    text = re.sub(r"(?<![A-Za-z])(std|ddp|fsdp|lit|tp|pp|lora|resnet)(?![A-Za-z])", "STAGE", text)
    return re.sub(r"\d+", "N", text)


def test_every_file_has_the_text_of_a_file_slurm_runs():
    """So the files Slurm does not run launch as one that it runs does, and differ from it only
    in what `sbatch --test-only` checks (nodes, tasks, GPUs) and what the stage tests cover (the
    stage's script and flags, every Accelerate config)."""
    ran = {launch_text(name) for name in [*TRAINING_RUNS, *LORA_RUNS]}
    assert len(ran) < len(TRAINING_RUNS) + len(LORA_RUNS)  # the blanking leaves something shared
    assert [name for name in TRAINING_FILES + LORA_FILES if launch_text(name) not in ran] == []


def sbatch_test_only(cluster, path, site=None, *options):
    """`sbatch --test-only` of a file on the test cluster, or on the copy of a site's partition."""
    conf = cluster["logs"] / "sites" / site / "slurm.conf" if site else None
    return subprocess.run(["sbatch", "--test-only", *options, str(path)], cwd=KIT_ROOT,
                          env=slurm_env(cluster, conf), capture_output=True, text=True)


SITE_FILES = sorted(str(p.relative_to(KIT_ROOT)) for p in KIT_ROOT.glob("batchfiles/*/*.sh")
                    if p.parent.name != "ci")


@pytest.mark.parametrize("path", SITE_FILES)
def test_real_site_batch_file_passes_sbatch_test_only_on_a_copy_of_its_partition(cluster, path):
    """The copy has the site's partition with its time limit, and nodes of the site's cores, GPUs
    and memory: every request (nodes, tasks, cores, GPUs in the site's own syntax, time) fits."""
    profile = slurm.load_site(path.split("/")[1])
    assert_lands_where_it_asks(cluster, KIT_ROOT / path, profile)


def assert_lands_where_it_asks(cluster, path, profile):
    """`sbatch --test-only` on the site's copy: the job would start, in the partition it names
    (the site's default if none), on nodes with GPUs unless that is the CPU partition."""
    result = sbatch_test_only(cluster, path, profile["name"])
    assert result.returncode == 0 and "to start at" in result.stderr, (path, result.stderr)
    text = path.read_text()
    nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
    named = re.search(r"^#SBATCH --partition=(\S+)$", text, re.M)
    partition = named[1] if named else site_partition(profile)
    node_set = "cpu" if partition == profile["cpu_partition"] else "gpu"
    assert (f"on nodes {f'{node_set}[1-2]' if nodes == 2 else f'{node_set}1'} "
            f"in partition {partition}") in result.stderr, (path, result.stderr)
    return partition


def test_a_split_sites_files_each_land_in_a_partition_that_takes_them(cluster, split_site,
                                                                      tmp_path):
    """Issue 48, item 2: a site with partitions by shape (one node at most in gpusmall), a test
    partition with a short limit and CPU nodes of another architecture. Every file the generator
    writes lands in a partition that takes it; each partition of the copy refuses what the site's
    would: two nodes in gpusmall, a training job's hours in gputest, GPUs in small."""
    root, profile = split_site
    files = slurm.expected_files("split", root)
    landed = {}
    for name, text in files.items():
        path = tmp_path / name.split("/")[-1]
        path.write_text(text)
        landed[path.name] = assert_lands_where_it_asks(cluster, path, profile)
    assert {landed[job] for job in slurm.CPU_JOBS} == {"small"}
    assert {landed["batch-ddp-1n1g.sh"], landed["batch-ddp-1n2g.sh"]} == {"gpusmall"}
    assert {landed["batch-ddp-1n4g.sh"], landed["batch-ddp-2n2g.sh"]} == {"gpumedium"}
    assert {landed["batch-selftest-1n4g.sh"], landed["batch-selftest-2n2g.sh"]} == {"gputest"}
    assert "module load python-data" in files["batchfiles/split/batch-data.sh"]
    assert "module load python-data" not in files["batchfiles/split/batch-ddp-1n4g.sh"]
    for options, file, reason in (
            (["--partition=gpusmall"], "batch-ddp-2n2g.sh", "Node count specification invalid"),
            (["--partition=gputest"], "batch-ddp-1n4g.sh", "Requested time limit is invalid"),
            (["--partition=small"], "batch-ddp-1n4g.sh",
             "Requested node configuration is not available")):
        refused = sbatch_test_only(cluster, tmp_path / file, "split", *options)
        assert refused.returncode != 0 and reason in refused.stderr, (options, refused.stderr)


# A profile with a value its site cannot meet (or a request added at submission), and why the
# site's scheduler refuses the batch file the generator writes from it
REFUSED = {
    "more-gpus-than-a-node": ("leonardo", {"cpus_per_gpu": 4}, slurm.Topology(1, 8), [],
                              "Requested node configuration is not available"),
    "more-cores-than-a-node": ("baskerville", {"cpus_per_gpu": 72}, slurm.Topology(1, 4), [],
                               "Requested node configuration is not available"),
    "more-cores-over-its-tasks-than-a-node": ("lumi", {"cpus_per_gpu": 8}, slurm.Topology(1, 8), [],
                                              "Requested node configuration is not available"),
    "longer-than-the-partition-allows": ("lumi", {"time": "49:00:00"}, slurm.Topology(2, 8), [],
                                         "Requested time limit is invalid"),
    "a-partition-the-site-lacks": ("meluxina", {"partition": "gpu-long"}, slurm.Topology(1, 4),
                                   [], "Invalid partition name specified"),
    "more-memory-than-a-node": ("leonardo", {}, slurm.Topology(1, 4), ["--mem=500G"],
                                "Requested node configuration is not available"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_sites_copy_refuses_what_the_site_would(cluster, tmp_path, case):
    site, change, topology, options, reason = REFUSED[case]
    path = tmp_path / "batch-ddp.sh"
    path.write_text(slurm.training_job("ddp", topology, {**slurm.load_site(site), **change}))
    result = sbatch_test_only(cluster, path, site, *options)
    assert result.returncode != 0 and reason in result.stderr, result.stderr


def test_data_job_prepares_the_corpus_byte_for_byte_again(cluster, builtin_in_kit):
    """The job builds data/builtin again, as `make` built it before the tests: the same bytes
    (DESIGN.md section 4: the corpus is deterministic for a given environment)."""
    corpus = KIT_ROOT / "data" / "builtin"
    before = {p.name: p.read_bytes() for p in sorted(corpus.glob("*.npy"))}
    submitted = time.time()
    job_id = submit(cluster, "batch-data.sh")
    status, _ = wait_for_job(cluster, job_id)
    log = (cluster["logs"] / f"batch-data.sh.{job_id}.out").read_text()
    assert status == 0, log[-3000:]
    assert "prepared builtin in data/builtin" in log
    assert data.read_meta(corpus)["splits"]["train"]["tokens"] > 500_000
    after = {p.name: p.read_bytes() for p in sorted(corpus.glob("*.npy"))}
    assert before and list(after) == list(before)
    assert all((corpus / name).stat().st_mtime > submitted for name in after)  # written anew
    assert [name for name in before if after[name] != before[name]] == []


def test_images_job_draws_the_same_images_again(cluster, shapes_in_kit):
    """The job that prepares the images, writing into a folder of the test's own (the command
    refuses to overwrite data/shapes): every file and shard the same bytes as data/shapes."""
    out = cluster["logs"] / "shapes"
    command = CI["images_command"].replace(f"--out {CI['images']}", f"--out {out}")
    assert command != CI["images_command"]
    batch_file(cluster, IMAGES_AGAIN).write_text(
        slurm.data_job({**CI, "images": str(out), "images_command": command}, "batch-images.sh"))
    job_id = submit(cluster, IMAGES_AGAIN)
    status, _ = wait_for_job(cluster, job_id)
    log = (cluster["logs"] / f"{IMAGES_AGAIN}.{job_id}.out").read_text()
    assert status == 0 and f"prepared shapes in {out}" in log, log[-3000:]
    kit = KIT_ROOT / CI["images"]
    made = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(kit) for p in kit.rglob("*") if p.is_file())
    assert [p for p in made if (out / p).read_bytes() != (kit / p).read_bytes()] == []


def test_course_files_job_makes_what_the_lessons_read(cluster):
    """`make course-files` in a job, in the kit where `make test` made them before the tests: the
    job's environment runs make and its targets, which end up (still) complete."""
    job_id = submit(cluster, "batch-course-files.sh")
    status, _ = wait_for_job(cluster, job_id)
    log = (cluster["logs"] / f"batch-course-files.sh.{job_id}.out").read_text()
    assert status == 0, log[-3000:]
    made = ["data/builtin/meta.json", "data/instruct/meta.json", "data/shapes/meta.json",
            "models/kit-tiny/config.json", "models/kit-embed/modules.json"]
    assert [name for name in made if not (KIT_ROOT / name).is_file()] == []


@pytest.mark.parametrize("args, line", [
    ((), "usage: sbatch batchfiles/ci/batch-autograde.sh LESSON [--root COURSE_DIR]"),
    (("99-none",), f"error: '99-none' is not a lesson of the course in {KIT_ROOT}: choose from "
                   "00-gpus-and-hpc, "),
    (("02-ddp", "--root", "/nonexistent"), "error: '02-ddp' is not a lesson of the course in "
                                           "/nonexistent: choose from (none: "),
], ids=["no-lesson", "not-a-lesson", "no-course"])
def test_autograde_job_passes_its_arguments_to_autograde(cluster, args, line):
    """The job's arguments reach `coursekit autograde` word for word, whose refusals (its
    grading is tested in test_grading.py) come back in one line: the job ran the kit's command."""
    job_id = submit(cluster, "batch-autograde.sh", args=args)
    status, _ = wait_for_job(cluster, job_id)
    log = (cluster["logs"] / f"batch-autograde.sh.{job_id}.out").read_text()
    assert status != 0 and log.startswith(line) and log.count("\n") == 1, log[-3000:]


def test_mlflow_ui_job_serves_the_tracking_store_to_its_owner_on_loopback_only(cluster):
    job_id = submit(cluster, "batch-mlflow-ui.sh")
    log = cluster["logs"] / f"batch-mlflow-ui.sh.{job_id}.out"
    try:
        port = int(wait_until(lambda: log.exists() and re.search(r":(\d+) \(127\.0\.0\.1 only\)",
                                                                 log.read_text()),
                              120, "the job did not print its port").group(1))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(f"{url}/health"), 180, "the MLflow UI did not answer")
        search = f"{url}/api/2.0/mlflow/experiments/search?max_results=5"
        assert http_get(search)[0] == 401  # what another user of the node gets
        status, body = http_get(search, owner_login(KIT_ROOT / "runs" / "mlflow-server"))
        assert status == 200 and "experiments" in json.loads(body)
        assert listening_addresses(port) == {"127.0.0.1"}
        assert f"-L {port}:127.0.0.1:{port}" in log.read_text()
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env(cluster), check=True)


def test_lab_job_serves_jupyterlab_to_its_owner_on_loopback_until_its_time_limit(cluster,
                                                                                 cotenant):
    """batch-lab.sh, with a time limit of a minute: JupyterLab answers its token alone, on
    127.0.0.1 alone, at the port of the tunnel its log prints, and stops at the time limit."""
    job_id = submit(cluster, "batch-lab.sh", "--time=00:01:00")
    log = cluster["logs"] / f"batch-lab.sh.{job_id}.out"
    try:
        port = int(wait_until(lambda: log.exists() and re.search(
            r"^JupyterLab on \S+:(\d+) \(127\.0\.0\.1 only\)", log.read_text(), re.M), 120,
            "the job did not print its port").group(1))
        token_file = KIT_ROOT / "runs" / "lab" / "token"
        assert oct(token_file.stat().st_mode & 0o777) == oct(0o600)
        assert oct(token_file.parent.stat().st_mode & 0o777) == oct(0o700)
        token = token_file.read_text().strip()
        status = f"http://127.0.0.1:{port}/api/status"
        assert http_get(status, headers={"Authorization": f"token {token}"})[0] == 200
        assert http_get(status)[0] == 403
        asked = cotenant.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", status,
                             check=False)
        assert asked.stdout == "403", asked
        assert cotenant.run("cat", str(token_file), check=False).returncode != 0
        assert listening_addresses(port) == {"127.0.0.1"}
        text = log.read_text()
        assert f"-L {port}:127.0.0.1:{port}" in text and token not in text
        _, record = wait_for_job(cluster, job_id, timeout=300)
        assert "JobState=TIMEOUT" in record, record
        assert "received signal 15, stopping" in log.read_text(), log.read_text()[-3000:]
        assert not answers(status)
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env(cluster), check=True)


def test_the_selftest_job_runs_both_its_launches_across_both_nodes(cluster, builtin_in_kit):
    """The self-test as an instructor submits it, across 2 nodes, with one stage of each of its
    two launches across nodes: ddp (srun, a torchrun per node, as fsdp, tp and pp are started,
    which TRAINING_RUNS run across nodes from their batch files) and lit (Lightning, a task per
    process). Every multi-process run started across both nodes, the reference and one-device runs
    on the first; its report says so. (On one node, as a GPU session runs it, with tp:
    tests/test_selftest.py.)"""
    name = SELFTEST_ACROSS_NODES
    job, command = slurm.selftest_job(CI, slurm.Topology(2, 1)), "python -m coursekit selftest "
    assert job.count(command) == 1
    batch_file(cluster, name).write_text(job.replace(command, f"{command}--stages ddp,lit "))
    out = KIT_ROOT / "runs" / "ci-selftest-2n1g"
    shutil.rmtree(out, ignore_errors=True)
    job_id = submit(cluster, name)
    status, record = wait_for_job(cluster, job_id)
    log = (cluster["logs"] / f"{name}.{job_id}.out").read_text()
    try:
        failed = "".join(path.read_text()[-2000:] for path in out.glob("runs/*/output.log")
                         if "Error" in path.read_text())  # a failed run's own output
        assert status == 0, log[-3000:] + failed
        assert f"self-test passed: {out}/selftest.md" in log  # absolute: it runs from anywhere
        report = runs.read_json(out / "selftest.json")
        assert report["ok"] and report["plan"]["processes"] == 2, report["failures"]
        assert {(r["stage"], r["processes"]) for r in report["runs"] if r["ok"]} == \
            {*[(s, 1) for s in ("std", "ddp", "lit")], *[(s, 2) for s in ("ddp", "lit")]}
        assert report["allreduce"]["ranks"] == 2
        assert "NodeList=node[1-2]" in record
        every_node = next(c for c in report["checks"] if c["name"] == "every node")
        assert every_node["ok"] and every_node["detail"].startswith("2 nodes (node1, node2)")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_jobs_that_cannot_run_say_why_at_once(cluster):
    """Lesson 10's Slurm mistakes, with the messages book/first-aid.md gives: sbatch refuses a
    partition that does not exist and more CPUs than a node has; a job whose environment is not
    there starts, fails within seconds, and its log says why first."""
    refused = {"--partition=gpu-typo": "invalid partition specified",
               f"--cpus-per-task={CI['cpus_per_node'] + 1}":
                   "Requested node configuration is not available"}
    for option, message in refused.items():
        result = subprocess.run(["sbatch", option, str(batch_file(cluster, "batch-std-1n1g.sh"))],
                                cwd=KIT_ROOT, env=slurm_env(cluster), capture_output=True,
                                text=True, timeout=60)
        assert result.returncode != 0 and message in result.stderr, result.stderr
    profile = {**CI, "setup": ["source .venv-typo/bin/activate"]}
    batch_file(cluster, NO_ENVIRONMENT).write_text(
        slurm.training_job("std", slurm.Topology(1, 1), profile))
    job_id = submit(cluster, NO_ENVIRONMENT)
    status, record = wait_for_job(cluster, job_id, timeout=120)
    log = (cluster["logs"] / f"{NO_ENVIRONMENT}.{job_id}.out").read_text()
    assert status != 0 and "JobState=FAILED" in record, record
    seconds = sum(int(part) * 60 ** i for i, part in
                  enumerate(reversed(re.search(r"RunTime=(\S+)", record).group(1).split(":"))))
    assert seconds < 30
    first_error = next(line for line in log.splitlines()
                       if re.search(r"error|no such file", line, re.IGNORECASE))
    assert ".venv-typo/bin/activate: No such file or directory" in first_error, log[:2000]


def gcs_answers(address, token=None):
    """Whether the Ray cluster's control plane (its GCS) answers a request for its nodes, sent
    with ``token`` or none: the number of nodes, or the refusal's gRPC status."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10,
                                        metadata=[("authorization", f"Bearer {token}")] if token
                                        else None)
        except grpc.RpcError as refusal:
            return refusal.code().name
        return len(reply.node_info_list)


def test_a_ray_cluster_spans_both_nodes_for_its_owner_alone_and_stops_on_sigusr1(
        cluster, tmp_path_factory):
    """The Ray job on 2 nodes with a driver that holds the cluster: a task ran on each node; the
    control plane and the dashboard refuse a request without the job's token, or with another;
    SIGUSR1 (the time limit's warning) stops the driver, then every node, and the job ends well,
    its nodes' private directories gone."""
    name = RAY_ACROSS_NODES
    batch_file(cluster, name).write_text(slurm.ray_job(CI, slurm.Topology(2, 1)))
    run = KIT_ROOT / "runs" / "ci-ray-2n1g"
    shutil.rmtree(run, ignore_errors=True)
    before = set(glob.glob("/tmp/ray-*"))
    with one_ray_at_a_time(tmp_path_factory):
        job_id = submit(cluster, name, args=["tests/helpers/ray_driver.py"])
        log = cluster["logs"] / f"{name}.{job_id}.out"
        try:
            text = driver_ready(cluster, job_id, log)
            check_ray_cluster_refuses_strangers(cluster, run, text)
        finally:
            subprocess.run(["scancel", "--batch", "--signal=USR1", job_id],
                           env=slurm_env(cluster))
        status, record = wait_for_job(cluster, job_id, timeout=120)
    assert status == 0 and "JobState=COMPLETED" in record, log.read_text()[-3000:]
    assert "SIGUSR1 received: the driver stops" in log.read_text()
    assert set(glob.glob("/tmp/ray-*")) == before  # each node's directory removed with it
    shutil.rmtree(run, ignore_errors=True)


#: How long the Ray job itself waits for its nodes (`coursekit ray-nodes`' default --timeout),
#: and then some for its head to start and its driver to connect: the test gives up no sooner.
RAY_JOB_PATIENCE_S = 300 + 120


def driver_ready(cluster, job_id, log):
    """The Ray job's log once its driver holds the cluster; fails with the log's end if the job
    ended first, or its driver was not ready as long as the job waits for its nodes."""
    def ready_or_ended():
        text = log.read_text() if log.exists() else ""
        return "driver ready" in text or job_state(cluster, job_id) in ENDED

    try:
        wait_until(ready_or_ended, RAY_JOB_PATIENCE_S, "the driver did not join the cluster",
                   every=SLURM_POLL_S)
    except AssertionError as late:
        raise AssertionError(f"{late}; the job's log ends: {log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert "driver ready" in text, f"the Ray job ended with no driver: {text[-3000:]}"
    return text


def check_ray_cluster_refuses_strangers(cluster, run, text):
    """A task ran on each node; the control plane and the dashboard (on loopback alone) refuse a
    request without the job's token, or with another."""
    assert "a task ran on each: node1, node2" in text and "driver ready: 2 nodes" in text
    head = re.search(r"ray cluster at (\S+):(\d+):", text)
    node_address = re.search(r"NodeAddr=(\S+)", scontrol(cluster, "show", "node", head[1]))[1]
    gcs = f"{node_address}:{head[2]}"
    token = (run / "ray-token").read_text().strip()
    assert oct((run / "ray-token").stat().st_mode & 0o777) == "0o600"
    assert gcs_answers(gcs) == gcs_answers(gcs, "not-the-token") == "UNAUTHENTICATED"
    assert gcs_answers(gcs, token) == 2
    # the last announced: a head that fails to start (a busy node) starts again on other ports
    *_, port = re.findall(r"dashboard: 127\.0\.0\.1:(\d+) ", text)
    # the socket the dashboard bound: loopback alone, not every interface of the node
    assert listening_addresses(int(port)) == {"127.0.0.1"}
    version = f"http://127.0.0.1:{port}/api/version"
    assert http_get(version)[0] == 401
    assert http_get(version, headers={"Authorization": f"Bearer {token}"})[0] == 200


def listening_addresses(port):
    """The addresses of this host on which something listens at ``port``: the socket a server
    actually bound, not what its command line asked for."""
    return {c.laddr.ip for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("name", [*TRAINING_RUNS, SRUN_LAUNCHED])
def test_training_job_finishes_with_its_loss_lines(training, name):
    status, log, metrics, job, config, _ = training.result(name)
    assert status == 0, log[-3000:]
    steps = STEPS
    assert re.search(rf"^step {steps}/{steps} \| loss \d+\.\d+ .* \| val \d+\.\d+"
                     rf"(, accuracy \d+\.\d%)?$", log,
                     re.MULTILINE), log[-3000:]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    nodes, processes = map(int, re.match(r"batch-\w+-(\d+)n(\d+)g", name).groups())
    assert config["world_size"] == nodes * processes
    # Slurm's record: the nodes, and the tasks it started (one per node for torchrun)
    tasks = nodes * (processes if name.startswith("batch-lit") or name == SRUN_LAUNCHED else 1)
    assert re.search(rf"NumNodes={nodes} NumCPUs=\d+ NumTasks={tasks} ", job), job
    assert f"NodeList={'node[1-2]' if nodes == 2 else 'node'}" in job


def test_every_shape_trains_the_same_model(training):
    """The minibatch is the same whatever the nodes, processes and launcher: so are the GPT
    stages' losses (the 4-process jobs run a smaller micro-batch to keep it)."""
    reference = [r["loss"] for r in training.result("batch-ddp-1n2g.sh")[2]]
    for name in [*GPT_RUNS, SRUN_LAUNCHED]:
        losses = [r["loss"] for r in training.result(name)[2]]
        assert losses == pytest.approx(reference, abs=1e-4), name


@pytest.fixture(scope="session")
def lora_training(request, cluster, builtin_in_kit, tmp_path_factory):
    """The lora stage's jobs, each run once, as the tests ask, on the model and tasks `make`
    prepares."""
    extensions = KIT_ROOT / ".cache" / "torch_extensions"  # DeepSpeed's CPU op, built once by make
    for target in ("models/kit-tiny/config.json", "data/instruct/meta.json",
                   ".cache/torch_extensions/.complete"):
        made_in_kit(tmp_path_factory, target)
    configs = {name: [f"--export=ALL,ACCELERATE_CONFIG=solutions/accelerate/{config}.yaml,"
                      f"TORCH_EXTENSIONS_DIR={extensions}"] for name, config in LORA_CONFIGS.items()}
    jobs = Jobs(cluster, wanted_by(request.session, "lora_training", LORA_RUNS), configs)
    yield jobs
    jobs.clean()


def test_lora_jobs_fine_tune_alike_on_every_shape(lora_training):
    """`accelerate launch` on 1 and 2 nodes (DDP on one, ZeRO-3 across both): every job finishes,
    saves the adapter and the merged model, and takes the same steps whatever its shape and
    config (no dropout, the same 32 examples)."""
    reference = [r["loss"] for r in lora_training.result("batch-lora-1n2g.sh")[2]]
    for name in LORA_RUNS:
        status, log, metrics, job, config, saved = lora_training.result(name)
        assert status == 0, log[-3000:]
        assert re.search(rf"^step {LORA_STEPS}/{LORA_STEPS} \| loss .* \| exact match", log,
                         re.MULTILINE), log[-3000:]
        nodes, processes = map(int, re.match(r"batch-lora-(\d+)n(\d+)g", name).groups())
        assert config["world_size"] == nodes * processes
        assert re.search(rf"NumNodes={nodes} NumCPUs=\d+ NumTasks={nodes} ", job), job
        assert "model/model.safetensors" in saved
        assert [r["loss"] for r in metrics] == pytest.approx(reference, abs=1e-4), name
        if name in LORA_CONFIGS:
            assert f"DEEPSPEED on {nodes * processes} process(es)" in log, log[-3000:]


# how a job is stopped mid-run: (what the test does, the signal the training processes get)
STOPS = {"scontrol-requeue": (["requeue"], "SIGTERM"),
         "time-limit-signal": (None, "SIGUSR1")}  # what --signal=B:USR1@S sends the batch shell
# The step after which the job is stopped: after the checkpoint of step 3, before the last step.
# Its processes hold there until the signal reaches them (tests/slurm/hold/sitecustomize.py).
HOLD_AT = 4


def held_at(step):
    """sbatch's option that makes the job's processes hold after `step` until signalled."""
    return f"--export=ALL,PYTHONPATH={held_pythonpath()},KIT_HOLD_AT_STEP={step}"


# The requeue tests' cases: (batch file, how it is stopped). Each way once: Slurm's requeue
# (SIGTERM to every process) with the ddp stage, the time limit's warning (SIGUSR1, passed on by
# the batch shell's trap) with the lora stage; the trap is the same text in every file, and every
# stage takes both signals alike (tests/test_stage_std.py). And the resnet stage, whose ranks
# agree on when to stop in a loop of their own, across 2 nodes.
REQUEUES = [("batch-ddp-1n2g.sh", "scontrol-requeue"), ("batch-lora-1n2g.sh", "time-limit-signal"),
            ("batch-resnet-2n1g.sh", "scontrol-requeue")]


class Requeues:
    """The requeue tests' jobs, started when the first test asks: those of one batch file (one run
    directory) one after another, those of different files side by side, so that one job's wait
    for Slurm to start it again is spent running another."""

    def __init__(self, cluster, jobs, cases):
        self.cluster, self.jobs, self.cases = cluster, jobs, cases  # jobs: Jobs of each file
        self.references, self.outcomes, self.threads = {}, {}, {}

    def result(self, name, how):
        """(the uninterrupted run's metrics, (exit status, `scontrol -d show job` as it ended, the
        log, the metrics)) of the case; raises what its run raised."""
        if not self.threads:
            for file in dict.fromkeys(name for name, _ in self.cases):
                self.references[file] = self.jobs[file].result(file)[2]
                self.threads[file] = threading.Thread(target=self.run, args=(file,), daemon=True)
                self.threads[file].start()
        self.threads[name].join()
        outcome = self.outcomes[name, how]
        if isinstance(outcome, BaseException):
            raise outcome
        return self.references[name], outcome

    def run(self, file):
        for name, how in self.cases:
            if name == file:
                try:
                    self.outcomes[name, how] = stop_and_requeue(self.cluster, name, how)
                except BaseException as failure:  # the test that asks for it raises it
                    self.outcomes[name, how] = failure


def stop_and_requeue(cluster, name, how):
    """Run the batch file held after step HOLD_AT, stop it as `how` says, and wait until Slurm has
    run it again to its end: (exit status, `scontrol -d show job` as it ended, log, metrics)."""
    steps = LORA_STEPS if "lora" in name else STEPS
    shutil.rmtree(run_dir(name), ignore_errors=True)
    job_id = submit(cluster, name, held_at(HOLD_AT))
    log = cluster["logs"] / f"{name}.{job_id}.out"
    wait_until(lambda: log.exists() and re.search(rf"^step {HOLD_AT}/{steps} ", log.read_text(),
                                                  re.MULTILINE), 600, f"no step {HOLD_AT}")
    action, _ = STOPS[how]
    if action:
        scontrol(cluster, *action, job_id)  # Slurm stops the job (SIGTERM) and queues it again
    else:  # the batch file's trap passes it on, waits for the checkpoint and requeues
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_env(cluster),
                       check=True)
    # requeued (Restarts counts it) or ended without: both stay so. Slurm starts it again once
    # the old run's credentials expire (cred_expire, 20 s on the test cluster): starting it sooner
    # by hand makes slurmd refuse it and the job fail
    wait_until(lambda: re.search(rf"Restarts=[1-9]|JobState=({'|'.join(ENDED)}) ",
                                 scontrol(cluster, "show", "job", job_id)),
               600, "the job was neither requeued nor ended", every=SLURM_POLL_S)
    status, record = wait_for_job(cluster, job_id)
    return status, record, log.read_text(), runs.read_metrics(run_dir(name))


@pytest.fixture(scope="session")
def requeued(request, cluster, training, lora_training):
    """The requeue cases the session's selected tests ask for."""
    cases = [case for case in REQUEUES if any(
        "requeued" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")
        and (item.callspec.params.get("name"), item.callspec.params.get("how")) == case
        for item in request.session.items)]
    jobs = {name: lora_training if "lora" in name else training for name, _ in cases}
    return Requeues(cluster, jobs, cases)


@pytest.mark.parametrize("name, how", REQUEUES)
def test_stopped_job_is_requeued_and_resumes_like_an_uninterrupted_one(requeued, name, how):
    reference, (status, record, text, got) = requeued.result(name, how)
    assert status == 0 and "JobState=COMPLETED" in record, text[-4000:] + record
    assert "Restarts=1 " in record, record
    signal_name = STOPS[how][1]
    # the ddp and resnet stages' ranks agree to stop in the all-reduce that carries the next
    # step's loss
    stopped_at = HOLD_AT if "lora" in name else HOLD_AT + 1
    assert f"{signal_name} received: checkpoint saved at step {stopped_at};" in text, text[-3000:]
    assert f"resumed from {run_dir(name).relative_to(KIT_ROOT)}/ckpt/step_{stopped_at:08d}" in text
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in got] == \
           [(r["step"], r["loss"], r.get("val_loss")) for r in reference]


class Studies(Jobs):
    """The hpo job arrays: one trial per process with the file's 2 array tasks, and 2-node trials
    with one task (it holds the whole test cluster)."""
    folder = staticmethod(study_dir)

    def submit(self, name):
        array = [] if name == "batch-hpo-1n1g.sh" else ["--array=0"]
        return submit(self.cluster, name, *array, log="{name}.%A_%a.out")

    def read(self, name, job_id, status, record):
        """(exit status, {array task: log}, the study's folder)"""
        logs = {int(p.name.rsplit("_", 1)[1].split(".")[0]): p.read_text()
                for p in self.cluster["logs"].glob(f"{name}.{job_id}_*.out")}
        return status, logs, study_dir(name)


@pytest.fixture(scope="session")
def studies(request, cluster, builtin_in_kit):
    jobs = Studies(cluster, wanted_by(request.session, "studies", HPO_FILES))
    yield jobs
    jobs.clean()


@pytest.mark.parametrize("name, tasks, world_size", [("batch-hpo-1n1g.sh", 2, 1),
                                                     ("batch-hpo-2n2g.sh", 1, 4)])
def test_hpo_array_tasks_are_workers_of_one_study(studies, name, tasks, world_size):
    import optuna

    status, logs, study = studies.result(name)
    assert status == 0 and sorted(logs) == list(range(tasks)), logs
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study / "journal.log")))
    trials = optuna.load_study(study_name="hpo-tiny", storage=storage).get_trials()
    counted = [t for t in trials if not t.user_attrs.get("surplus")]  # asks past --trials
    assert len(counted) == HPO_TRIALS and len(trials) <= HPO_TRIALS + tasks - 1
    assert [t.number for t in trials] == list(range(len(trials)))
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in counted)
    assert {t.user_attrs["worker"] for t in counted} == set(range(tasks))  # each task took some
    for trial in counted:
        config = runs.read_json(f"{trial.user_attrs['run_dir']}/config.json")
        assert config["world_size"] == world_size
    assert runs.read_json(study / "best.json")["trials"] == len(trials)


def test_the_training_monitor_follows_a_slurm_job_until_it_leaves_the_queue(cluster, builtin_in_kit,
                                                                            tmp_path, monkeypatch):
    for name, value in slurm_env(cluster).items():  # the widget's squeue asks the test cluster
        monkeypatch.setenv(name, value)
    train = " ".join([sys.executable, str(KIT_ROOT / "solutions" / "train_gpt2_std.py"),
                      "--preset tiny --max-steps 8 --eval-interval 4 --eval-steps 1",
                      f"--sample-tokens 0 --out {tmp_path / 'run'}"])
    job_id = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}",
                             f"--wrap={train}"], cwd=KIT_ROOT, capture_output=True, text=True,
                            check=True).stdout.split(";")[0].strip()
    monitor = widgets.TrainingMonitor(tmp_path / "run")
    assert monitor.follow(job_id=job_id, interval=1) is None
    assert job_state(cluster, job_id) == "COMPLETED", (tmp_path / "job.out").read_text()[-2000:]
    assert (monitor.progress.value, monitor.progress.max) == (8, 8)
    assert monitor.status.value.startswith("step 8 of 8: loss ")


def test_a_crashed_process_restarts_its_group_across_nodes_in_the_same_job(cluster, training):
    """Rank 1, on node2, dies by SIGKILL after step 4 (tests/helpers/fault), in the first two
    launches of the group. torchrun on each node starts its part of the group again
    (--max-restarts=2), which resumes from step 3; the third launch ends the job, in Slurm's
    first run of it, with the losses of the run nothing stopped."""
    name, reference = "batch-ddp-2n1g.sh", training.result("batch-ddp-1n2g.sh")[2]
    shutil.rmtree(run_dir(name), ignore_errors=True)
    hook = os.pathsep.join(filter(None, [str(KIT_ROOT / "tests" / "helpers" / "fault"),
                                         os.environ.get("PYTHONPATH")]))
    job_id = submit(cluster, name, f"--export=ALL,PYTHONPATH={hook},KIT_FAULT=dies 1 4,"
                                   "KIT_FAULT_LAUNCHES=2")
    status, record = wait_for_job(cluster, job_id)
    text = (cluster["logs"] / f"{name}.{job_id}.out").read_text()
    assert status == 0 and "JobState=COMPLETED" in record and "Restarts=0 " in record, \
        text[-4000:] + record
    assert text.count("lost a peer: another process died") == 2, text[-4000:]
    resumed = f"resumed from {run_dir(name).relative_to(KIT_ROOT)}/ckpt/step_00000003 at step 3"
    assert text.count(resumed) == 2, text[-4000:]
    metrics = runs.read_metrics(run_dir(name))
    assert [r["loss"] for r in metrics] == pytest.approx([r["loss"] for r in reference], abs=1e-4)
    shutil.rmtree(run_dir(name), ignore_errors=True)


def kill_node(cluster, node):
    """The node dies: SIGKILL to every process of its namespace (tests/slurm/node-up.sh), its
    slurmd, its job's step daemon and training processes. No one is told."""
    slurmd = int((cluster["logs"] / "run" / f"slurmd.{node}.pid").read_text())
    namespace = os.readlink(f"/proc/{slurmd}/ns/uts")
    for process in psutil.process_iter():
        try:
            if os.readlink(f"/proc/{process.pid}/ns/uts") == namespace:
                process.kill()
        except (OSError, psutil.Error):  # gone already
            pass


def queue_is_empty(cluster):
    return subprocess.run(["squeue", "--noheader", "--format=%i"], env=slurm_env(cluster),
                          capture_output=True, text=True, check=True).stdout.strip() == ""


def test_a_job_whose_node_dies_is_requeued_and_ends_like_an_uninterrupted_one(cluster, training):
    """node2 dies after step 4 of a 2-node job (its checkpoint: step 3). Slurm marks it down when
    its slurmd stops answering (SlurmdTimeout), fails the job's step on node1 and requeues the
    job (--requeue). Once node2 is back, the job runs again, resumes from step 3 and ends with
    the losses of the run nothing stopped. It kills a node: it starts once every other job has
    ended, wherever it runs in the file, and leaves both nodes up."""
    name, reference = "batch-ddp-2n1g.sh", training.result("batch-ddp-1n2g.sh")[2]
    wait_until(lambda: queue_is_empty(cluster), 900, "the other jobs did not end",
               every=SLURM_POLL_S)
    shutil.rmtree(run_dir(name), ignore_errors=True)
    job_id = submit(cluster, name, held_at(HOLD_AT))
    log = cluster["logs"] / f"{name}.{job_id}.out"
    wait_until(lambda: log.exists() and re.search(rf"^step {HOLD_AT}/{STEPS} ", log.read_text(),
                                                  re.MULTILINE), 600, f"no step {HOLD_AT}")
    kill_node(cluster, "node2")
    wait_until(lambda: "Restarts=1 " in scontrol(cluster, "show", "job", job_id), 120,
               "the job was not requeued after its node died", every=SLURM_POLL_S)
    assert "State=DOWN" in scontrol(cluster, "show", "node", "node2")
    subprocess.run(["bash", str(KIT_ROOT / "tests" / "slurm" / "node-up.sh"), "2"],
                   env=slurm_env(cluster), check=True, timeout=60)
    status, record = wait_for_job(cluster, job_id)
    text = log.read_text()
    assert status == 0 and "JobState=COMPLETED" in record, text[-4000:] + record
    assert "Restarts=1 " in record and "DUE TO NODE FAILURE" in text
    assert f"resumed from {run_dir(name).relative_to(KIT_ROOT)}/ckpt/step_00000003" in text
    metrics = runs.read_metrics(run_dir(name))
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in metrics] == pytest.approx([r["loss"] for r in reference], abs=1e-4)
    shutil.rmtree(run_dir(name), ignore_errors=True)
