"""The ci site's batch files on a real 2-node Slurm cluster (tests/slurm/cluster-up.sh): every file
passes `sbatch --test-only` and runs to exit 0 with its loss lines; the 2-node jobs really use both
nodes; a job requeued mid-run resumes from its checkpoint and ends where an uninterrupted run does."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from coursekit import KIT_ROOT, data, runs, slurm, widgets

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
CI_FILES = sorted(p.name for p in (KIT_ROOT / "batchfiles" / "ci").glob("*.sh"))
TRAINING_FILES = [name for name in CI_FILES if name not in ("batch-data.sh", "batch-mlflow-ui.sh")
                  and not name.startswith(("batch-lora", "batch-hpo"))]
LORA_FILES = [name for name in CI_FILES if name.startswith("batch-lora")]
HPO_FILES = [name for name in CI_FILES if name.startswith("batch-hpo")]
HPO_TRIALS = int(re.search(r"--trials (\d+)", slurm.load_site("ci")["hpo_args"]).group(1))
LORA_STEPS = int(re.search(r"--max-steps (\d+)", slurm.load_site("ci")["finetune_args"]).group(1))
# The ddp stage started by srun, one task per process (the launcher of sites that bind each task
# to its cores, such as LUMI), generated into the test's folder: 2 nodes x 2 tasks
SRUN_LAUNCHED = "batch-ddp-2n2g-srun.sh"
STEPS = int(re.search(r"--max-steps (\d+)", slurm.load_site("ci")["train_args"]).group(1))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A Slurm cluster of 2 nodes on this machine, up for the session, stopped by PID after it."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root: it starts munged, slurmctld and slurmd")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it from Debian")
    directory = tmp_path_factory.mktemp("slurm-ci")
    env = {**os.environ, "SLURM_CI_DIR": str(directory)}
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


def slurm_env(cluster):
    return {name: value for name, value in cluster.items() if name != "logs"}


def run_dir(name):
    stage, topology, launcher = re.match(r"batch-(\w+)-(\d+n\d+g)(-srun)?\.sh", name).groups()
    return KIT_ROOT / "runs" / f"ci{launcher or ''}-{stage}-{topology}"


def batch_file(cluster, name):
    if name == SRUN_LAUNCHED:
        return cluster["logs"] / name
    return KIT_ROOT / "batchfiles" / "ci" / name


def write_srun_launched(cluster):
    profile = {**slurm.load_site("ci"), "launcher": "srun", "name": "ci-srun"}
    batch_file(cluster, SRUN_LAUNCHED).write_text(
        slurm.training_job("ddp", slurm.Topology(2, 2), profile))


def submit(cluster, name, wait=True):
    """sbatch a batch file from the kit's root, its log in the test's folder. With wait, the
    running `sbatch --wait` (whose exit status is the job's); without, the job id."""
    log = cluster["logs"] / f"{name}.%j.out"
    command = ["sbatch", "--parsable", f"--output={log}", *(["--wait"] if wait else []),
               str(batch_file(cluster, name))]
    sbatch = subprocess.Popen(command, cwd=KIT_ROOT, env=slurm_env(cluster),
                              stdout=subprocess.PIPE, text=True)
    sbatch.job_id = sbatch.stdout.readline().split(";")[0].strip()
    if wait:
        return sbatch
    sbatch.wait(timeout=60)
    return sbatch.job_id


def finish(cluster, name, sbatch):
    """Wait for a submitted job: (exit status, log, `scontrol -d show job` as it ended)."""
    status = sbatch.wait(timeout=900)
    log = (cluster["logs"] / f"{name}.{sbatch.job_id}.out").read_text()
    return status, log, scontrol(cluster, "-d", "show", "job", sbatch.job_id)


def job_state(cluster, job_id):
    return re.search(r"JobState=(\w+)", scontrol(cluster, "show", "job", job_id)).group(1)


def scontrol(cluster, *args):
    return subprocess.run(["scontrol", *args], env=slurm_env(cluster), capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(scope="session")
def finished(cluster, builtin_in_kit):
    """Each training file's job, run to the end once:
    {file: (status, log, metrics, `scontrol -d show job` read as it ended)}."""
    write_srun_launched(cluster)
    names = [*TRAINING_FILES, SRUN_LAUNCHED]
    for name in names:
        shutil.rmtree(run_dir(name), ignore_errors=True)
    # all at once: Slurm runs them as its 2 nodes allow, and sbatch's polling overlaps
    submitted = {name: submit(cluster, name) for name in names}
    results = {}
    for name, sbatch in submitted.items():
        status, log, details = finish(cluster, name, sbatch)
        results[name] = (status, log, runs.read_metrics(run_dir(name)), details)
    yield results
    for name in names:
        shutil.rmtree(run_dir(name), ignore_errors=True)


@pytest.mark.parametrize("name", CI_FILES)
def test_batch_file_passes_sbatch_test_only(cluster, name):
    result = subprocess.run(["sbatch", "--test-only", f"batchfiles/ci/{name}"], cwd=KIT_ROOT,
                            env=slurm_env(cluster), capture_output=True, text=True)
    assert result.returncode == 0 and "to start at" in result.stderr, result.stderr


SITE_FILES = sorted(str(p.relative_to(KIT_ROOT)) for p in KIT_ROOT.glob("batchfiles/*/*.sh")
                    if p.parent.name != "ci")


@pytest.mark.parametrize("path", SITE_FILES)
def test_real_site_batch_file_passes_sbatch_test_only_on_gpu_shaped_nodes(cluster, path):
    """The cluster's "sites" partition has nodes of 8 GPUs and 288 cores: every real site's
    request (nodes, tasks, cores, GPUs in the site's own syntax) must fit them."""
    result = subprocess.run(["sbatch", "--test-only", "--partition=sites", path], cwd=KIT_ROOT,
                            env=slurm_env(cluster), capture_output=True, text=True)
    assert result.returncode == 0 and "to start at" in result.stderr, result.stderr
    nodes = int(re.search(r"--nodes=(\d+)", (KIT_ROOT / path).read_text()).group(1))
    assert f"on nodes {'site[1-2]' if nodes == 2 else 'site1'}" in result.stderr, result.stderr


def test_data_job_prepares_the_corpus(cluster):
    status, log, _ = finish(cluster, "batch-data.sh", submit(cluster, "batch-data.sh"))
    assert status == 0, log[-3000:]
    assert "prepared builtin in data/builtin" in log
    assert data.read_meta(KIT_ROOT / "data" / "builtin")["splits"]["train"]["tokens"] > 500_000


def test_mlflow_ui_job_serves_the_tracking_store_on_loopback_only(cluster):
    job_id = submit(cluster, "batch-mlflow-ui.sh", wait=False)
    log = cluster["logs"] / f"batch-mlflow-ui.sh.{job_id}.out"
    try:
        port = int(wait_until(lambda: log.exists() and re.search(r":(\d+) \(127\.0\.0\.1 only\)",
                                                                 log.read_text()), 120).group(1))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(f"{url}/health"), 180)
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=5") as r:
            assert "experiments" in json.load(r)
        listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}
        assert f"-L {port}:127.0.0.1:{port}" in log.read_text()
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env(cluster), check=True)


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(1)
    raise AssertionError(f"not ready within {timeout} s")


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("name", [*TRAINING_FILES, SRUN_LAUNCHED])
def test_training_job_finishes_with_its_loss_lines(finished, name):
    status, log, metrics, job = finished[name]
    assert status == 0, log[-3000:]
    steps = STEPS
    assert re.search(rf"^step {steps}/{steps} \| loss \d+\.\d+ .* \| val \d+\.\d+$", log,
                     re.MULTILINE), log[-3000:]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    nodes, processes = map(int, re.match(r"batch-\w+-(\d+)n(\d+)g", name).groups())
    config = runs.read_json(run_dir(name) / "config.json")
    assert config["world_size"] == nodes * processes
    # Slurm's record: the nodes, and the tasks it started (one per node for torchrun)
    tasks = nodes * (processes if name.startswith("batch-lit") or name == SRUN_LAUNCHED else 1)
    assert re.search(rf"NumNodes={nodes} NumCPUs=\d+ NumTasks={tasks} ", job), job
    assert f"NodeList={'node[1-2]' if nodes == 2 else 'node'}" in job


def test_every_shape_trains_the_same_model(finished):
    """The minibatch is the same whatever the nodes, processes and launcher: so are the losses
    (the 4-process jobs run a smaller micro-batch to keep it)."""
    losses = {name: [r["loss"] for r in metrics] for name, (_, _, metrics, _) in finished.items()}
    for name in ("batch-std-1n1g.sh", "batch-ddp-1n1g.sh", "batch-ddp-2n1g.sh", "batch-ddp-2n2g.sh",
                 SRUN_LAUNCHED, "batch-fsdp-1n2g.sh", "batch-fsdp-2n1g.sh", "batch-fsdp-2n2g.sh",
                 "batch-lit-1n2g.sh", "batch-lit-2n1g.sh", "batch-lit-2n2g.sh",
                 "batch-tp-1n2g.sh", "batch-tp-2n1g.sh", "batch-tp-2n2g.sh",
                 "batch-pp-1n2g.sh", "batch-pp-2n1g.sh", "batch-pp-2n2g.sh"):
        assert losses[name] == pytest.approx(losses["batch-ddp-1n2g.sh"], abs=1e-4), name


@pytest.fixture(scope="session")
def lora_finished(cluster, builtin_in_kit):
    """The lora stage's jobs, run to the end once, on the model and tasks `make` prepares."""
    subprocess.run(["make", "models/kit-tiny/config.json", "data/instruct/meta.json"],
                   cwd=KIT_ROOT, check=True, capture_output=True, timeout=900)
    for name in LORA_FILES:
        shutil.rmtree(run_dir(name), ignore_errors=True)
    submitted = {name: submit(cluster, name) for name in LORA_FILES}
    results = {}
    for name, sbatch in submitted.items():
        status, log, details = finish(cluster, name, sbatch)
        results[name] = (status, log, runs.read_metrics(run_dir(name)), details)
    yield results
    for name in LORA_FILES:
        shutil.rmtree(run_dir(name), ignore_errors=True)


def test_lora_jobs_fine_tune_alike_on_every_shape(lora_finished):
    """`accelerate launch` on 1 and 2 nodes: every job finishes, saves the adapter and the merged
    model, and takes the same steps whatever its shape (no dropout, the same 32 examples)."""
    reference = [r["loss"] for r in lora_finished["batch-lora-1n1g.sh"][2]]
    for name, (status, log, metrics, job) in lora_finished.items():
        assert status == 0, log[-3000:]
        assert re.search(rf"^step {LORA_STEPS}/{LORA_STEPS} \| loss .* \| exact match", log,
                         re.MULTILINE), log[-3000:]
        nodes, processes = map(int, re.match(r"batch-lora-(\d+)n(\d+)g", name).groups())
        assert runs.read_json(run_dir(name) / "config.json")["world_size"] == nodes * processes
        assert re.search(rf"NumNodes={nodes} NumCPUs=\d+ NumTasks={nodes} ", job), job
        assert (run_dir(name) / "model" / "model.safetensors").is_file()
        assert [r["loss"] for r in metrics] == pytest.approx(reference, abs=1e-4), name


# how a job is stopped mid-run: (what the test does, the signal the training processes get)
STOPS = {"scontrol-requeue": (["requeue"], "SIGTERM"),
         "time-limit-signal": (None, "SIGUSR1")}  # what --signal=B:USR1@S sends the batch shell


@pytest.mark.parametrize("name, how", [("batch-ddp-1n2g.sh", "scontrol-requeue"),
                                       ("batch-ddp-1n2g.sh", "time-limit-signal"),
                                       ("batch-lora-1n2g.sh", "time-limit-signal")])
def test_stopped_job_is_requeued_and_resumes_like_an_uninterrupted_one(cluster, finished,
                                                                       lora_finished, name, how):
    reference = (lora_finished if "lora" in name else finished)[name][2]
    steps = LORA_STEPS if "lora" in name else STEPS
    shutil.rmtree(run_dir(name), ignore_errors=True)
    job_id = submit(cluster, name, wait=False)
    deadline = time.time() + 600
    while len(runs.read_metrics(run_dir(name))) < 4:
        assert time.time() < deadline, "the job did not start training"
        time.sleep(0.2)
    action, signal_name = STOPS[how]
    if action:
        scontrol(cluster, *action, job_id)  # Slurm stops the job (SIGTERM) and queues it again
    else:  # the batch file's trap passes it on, waits for the checkpoint and requeues
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_env(cluster),
                       check=True)
    while job_state(cluster, job_id) != "PENDING":
        assert time.time() < deadline, "the job was not requeued"
        time.sleep(0.2)
    # Slurm starts it again once the old run's credentials expire (cred_expire, 20 s on the test
    # cluster): starting it sooner by hand makes slurmd refuse it and the job fail
    while job_state(cluster, job_id) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.time() < deadline, "the requeued job did not finish"
        time.sleep(0.5)
    log = (cluster["logs"] / f"{name}.{job_id}.out").read_text()
    record = scontrol(cluster, "show", "job", job_id)
    assert "JobState=COMPLETED" in record, log[-4000:] + record
    stopped = re.search(rf"{signal_name} received: checkpoint saved at step (\d+)", log)
    assert stopped and 4 <= int(stopped.group(1)) < steps, log[-3000:]
    assert f"resumed from {run_dir(name).relative_to(KIT_ROOT)}/ckpt/step_{int(stopped.group(1)):08d}" \
        in log
    assert "Restarts=1" in record
    got = runs.read_metrics(run_dir(name))
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in got] == \
           [(r["step"], r["loss"], r.get("val_loss")) for r in reference]


@pytest.fixture(scope="session")
def hpo_finished(cluster, builtin_in_kit):
    """The hpo job arrays, run to the end: one trial per process with the file's 2 array tasks,
    and 2-node trials with one task (it holds the whole test cluster)."""
    results = {}
    for name in HPO_FILES:
        study_dir = KIT_ROOT / "runs" / f"ci-{name.removeprefix('batch-').removesuffix('.sh')}"
        shutil.rmtree(study_dir, ignore_errors=True)
        array = [] if name == "batch-hpo-1n1g.sh" else ["--array=0"]
        sbatch = subprocess.run(["sbatch", "--wait", "--parsable", *array,
                                 f"--output={cluster['logs']}/{name}.%A_%a.out",
                                 f"batchfiles/ci/{name}"], cwd=KIT_ROOT, env=slurm_env(cluster),
                                capture_output=True, text=True, timeout=900)
        job_id = sbatch.stdout.split(";")[0].strip()
        logs = {int(p.name.rsplit("_", 1)[1].split(".")[0]): p.read_text()
                for p in cluster["logs"].glob(f"{name}.{job_id}_*.out")}
        results[name] = (sbatch.returncode, logs, study_dir)
    yield results
    for _, _, study_dir in results.values():
        shutil.rmtree(study_dir, ignore_errors=True)


@pytest.mark.parametrize("name, tasks, world_size", [("batch-hpo-1n1g.sh", 2, 1),
                                                     ("batch-hpo-2n2g.sh", 1, 4)])
def test_hpo_array_tasks_are_workers_of_one_study(hpo_finished, name, tasks, world_size):
    import optuna

    status, logs, study_dir = hpo_finished[name]
    assert status == 0 and sorted(logs) == list(range(tasks)), logs
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study_dir / "journal.log")))
    trials = optuna.load_study(study_name="hpo-tiny", storage=storage).get_trials()
    assert HPO_TRIALS <= len(trials) <= HPO_TRIALS + tasks - 1
    assert [t.number for t in trials] == list(range(len(trials)))
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert {t.user_attrs["worker"] for t in trials} == set(range(tasks))  # each task took some
    for trial in trials:
        config = runs.read_json(f"{trial.user_attrs['run_dir']}/config.json")
        assert config["world_size"] == world_size
    assert runs.read_json(study_dir / "best.json")["trials"] == len(trials)


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
