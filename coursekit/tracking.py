"""Experiment tracking for the stage scripts: ``--track {none,mlflow,tensorboard}``.

A stage script's rank 0 starts a tracker next to its run directory, hands it every step's record
(the same numbers as ``metrics.jsonl``) and finishes it with the final checkpoint:

    tracker = tracking.start(args.track, run_dir, resumed=start_step > 0)  # after runs.start_run
    tracker.log_step(record)
    tracker.finish(run_dir, checkpoint)

MLflow logs to ``MLFLOW_TRACKING_URI`` when it is set (an ``mlflow server`` over HTTP, say) and
otherwise to ``RUN_DIR/../mlflow.db`` (SQLite, artifacts in ``RUN_DIR/../mlartifacts``), so every
run under ``runs/`` lands in one place to compare. The experiment is ``MLFLOW_EXPERIMENT_NAME`` or
"coursekit"; the run is named after the run directory, and ``RUN_DIR/tracking.json`` remembers its
id so that ``--resume`` continues the same MLflow run. TensorBoard writes event files to
``RUN_DIR/tensorboard``. The Lightning stage builds Lightning's own loggers with
``lightning_logger`` and wraps them in the same tracker.
"""
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from coursekit import KIT_ROOT, KitError, caches, runs

BACKENDS = ("none", "mlflow", "tensorboard")
# what a run directory holds besides checkpoints (each stage writes some of them)
RUN_FILES = ("config.json", "metrics.jsonl", "memory.json", "sample.txt", "eval.json",
             "predictions.jsonl")
EXPERIMENT = "coursekit"
# MLflow reports usage to its developers unless told not to; compute nodes are often offline.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A tracking server that has gone away fails a request at once, not after minutes of retries
# (MLflow's defaults: 7 of them, backing off to 2 minutes, each waiting 120 s for an answer):
# metrics.jsonl keeps every step, and a resumed run logs what the server missed.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def add_argument(parser):
    parser.add_argument("--track", choices=BACKENDS, default="none",
                        help="log params, per-step metrics and artifacts to MLflow "
                             "(MLFLOW_TRACKING_URI, else RUN_DIR/../mlflow.db) or TensorBoard "
                             "(RUN_DIR/tensorboard); rank 0 only")


def start(backend, run_dir, resumed):
    """The tracker for ``backend``, described by the run's config.json. Only the first process
    logs: the others (RANK or SLURM_PROCID > 0, as torchrun, Accelerate and srun set them), and
    ``--track none``, get a tracker that does nothing."""
    if global_rank() != 0:
        return Tracker()
    if backend == "mlflow":
        with store_errors(run_dir):
            tracker = MlflowTracker.open(run_dir, resumed)
    elif backend == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        tracker = TensorBoardTracker(SummaryWriter(str(Path(run_dir) / "tensorboard")))
    else:
        return Tracker()
    if not resumed:
        with store_errors(run_dir):
            tracker.describe(runs.read_json(Path(run_dir) / "config.json"))
    return tracker


@contextlib.contextmanager
def store_errors(run_dir):
    """A tracking store that cannot be reached or refuses a write is a one-line KitError naming
    it (the run's checkpoints are written before and do not depend on it)."""
    try:
        yield
    except Exception as err:  # MLflow raises its own, requests' and SQLAlchemy's errors
        if type(err).__module__.split(".")[0] not in ("mlflow", "requests", "sqlalchemy"):
            raise
        reason = " ".join(str(err).split())[:300]
        raise KitError(f"--track mlflow: the tracking store {tracking_uri(run_dir)} failed: "
                       f"{reason}") from None


def global_rank():
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


class Tracker:
    """What every tracker does; this one does nothing."""

    def describe(self, config):
        """Once per run: parameters, system information, lineage, environment."""

    def log_step(self, record):
        """One optimiser step's record from metrics.jsonl."""

    def finish(self, run_dir, checkpoint=None):
        """The run's artifacts, then close."""


# --- MLflow ----------------------------------------------------------------------------------

def tracking_uri(run_dir):
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{Path(run_dir).resolve().parent / 'mlflow.db'}"


def artifact_folder(run_dir):
    """With the default SQLite store, artifacts go next to the database; a server chooses its
    own artifact store (None)."""
    if "MLFLOW_TRACKING_URI" in os.environ:
        return None
    return Path(run_dir).resolve().parent / "mlartifacts"


def artifact_location(run_dir):
    folder = artifact_folder(run_dir)
    return folder and folder.as_uri()


def make_store_private(uri, artifacts=None):
    """A SQLite store's file (0600), and the artifacts' folder (0700), made before MLflow makes
    them with the umask's 0644 and 0755: the store holds every run's parameters and metrics and
    the folder every logged checkpoint, which other users would read past the server's password.
    (SQLite gives its journal files the database's mode.)"""
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        database.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(database, os.O_CREAT | os.O_WRONLY, 0o600))  # an empty file is a new store
        runs.keep_private(database)
        # MLflow opens /tmp/db_init_lock-<hash of the URI> for writing: a link another user put
        # there first would be followed where the kernel allows it. This process's temporary
        # files go to a folder of the user's own, beside the store, instead.
        tempfile.tempdir = str(private_temp_folder(database))
    if artifacts is not None:
        runs.make_run_dir(artifacts)


def private_temp_folder(database):
    """The folder for temporary files of the processes that open ``database``: theirs alone."""
    return caches.private_folder(database.parent / ".tmp")


def experiment_name():
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)


def experiment_id(client, run_dir):
    """The experiment's id, created on first use. Runs that start together (a job array, an HPO
    sweep) may race to create it: the loser reads the winner's."""
    from mlflow.exceptions import MlflowException
    experiment = client.get_experiment_by_name(experiment_name())
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(experiment_name(),
                                         artifact_location=artifact_location(run_dir))
    except MlflowException:
        experiment = client.get_experiment_by_name(experiment_name())
        if experiment is None:
            raise
        return experiment.experiment_id


class MlflowTracker(Tracker):
    """Logs through an ``MlflowClient`` to one run (Lightning's MLFlowLogger exposes the same)."""

    def __init__(self, client, run_id):
        self.client, self.run_id = client, run_id
        self.queued = []  # the background writes of the step metrics

    @classmethod
    def open(cls, run_dir, resumed):
        from mlflow import MlflowClient
        saved = Path(run_dir) / "tracking.json"
        uri = tracking_uri(run_dir)
        make_store_private(uri, artifact_folder(run_dir))
        client = MlflowClient(tracking_uri=uri)
        if resumed and saved.exists() and runs.read_json(saved).get("tracking_uri") == uri:
            tracker = cls(client, runs.read_json(saved)["run_id"])
            client.update_run(tracker.run_id, status="RUNNING")
            tracker.log_missed_steps(run_dir)
        else:
            tracker = cls(client, client.create_run(experiment_id(client, run_dir),
                                                    run_name=Path(run_dir).resolve().name).info.run_id)
        remember_run(run_dir, uri, tracker.run_id)
        print(f"tracking: MLflow run {tracker.run_id} at {uri}")
        return tracker

    def log_missed_steps(self, run_dir):
        """Log the steps of metrics.jsonl that the store does not have: those trained while it
        was away (a resumed run re-does the steps after its checkpoint, and logs them again)."""
        logged = {metric.step for metric in self.client.get_metric_history(self.run_id, "loss")}
        for record in runs.read_metrics(run_dir):
            if record["step"] not in logged:
                self.log_step(record)

    def describe(self, config):
        from mlflow.entities import Param, RunTag
        params = [Param(key, str(value)[:6000]) for key, value in flatten(config).items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[first:first + 100])
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in
                                                 run_tags(config).items()])
        self.client.log_text(self.run_id, installed_packages(), "environment/requirements.txt")

    def log_step(self, record):
        from mlflow.entities import Metric
        step = record["step"]
        metrics = [Metric(key, float(value), timestamp_ms(), step)
                   for key, value in record.items() if key != "step"]
        # queued and written by a background thread: the training loop does not wait for the store
        self.queued.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))

    def finish(self, run_dir, checkpoint=None):
        """Upload the artifacts and end the run. A store that went away during the run (a server
        stopped, a node lost) is a warning, not an error: the run itself is complete."""
        try:
            with store_errors(run_dir):
                self.upload(Path(run_dir), checkpoint)
        except KitError as lost:
            print(f"warning: {lost}; metrics.jsonl holds every step: run again with --resume "
                  "once the store is back, and its MLflow run gets the steps it missed",
                  file=sys.stderr, flush=True)

    def upload(self, run_dir, checkpoint):
        for operation in self.queued:  # a write that failed in the background fails here
            operation.wait()
        for name in RUN_FILES:
            if (run_dir / name).exists():
                self.client.log_artifact(self.run_id, str(run_dir / name))
        self.client.log_figure(self.run_id, loss_figure(run_dir), "loss.png")
        if checkpoint is not None:
            log_path(self.client, self.run_id, Path(checkpoint), "checkpoint")
        self.client.set_terminated(self.run_id)  # also waits for the queued metrics


def remember_run(run_dir, uri, run_id):
    runs.write_json_atomic(Path(run_dir) / "tracking.json",
                           {"backend": "mlflow", "tracking_uri": uri, "run_id": run_id})


def log_path(client, run_id, path, artifact_path):
    if path.is_dir():
        client.log_artifacts(run_id, str(path), f"{artifact_path}/{path.name}")
    else:
        client.log_artifact(run_id, str(path.resolve()), artifact_path)


def timestamp_ms():
    return int(time.time() * 1000)


# --- TensorBoard -----------------------------------------------------------------------------

class TensorBoardTracker(Tracker):
    def __init__(self, writer):
        self.writer = writer

    def describe(self, config):
        table = "\n".join(f"| {key} | {value} |" for key, value in flatten(config).items())
        self.writer.add_text("config", "| parameter | value |\n|---|---|\n" + table)
        self.writer.add_text("system", json.dumps(run_tags(config), indent=2))

    def log_step(self, record):
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, record["step"])

    def finish(self, run_dir, checkpoint=None):
        sample = Path(run_dir) / "sample.txt"
        if sample.exists():
            self.writer.add_text("sample", sample.read_text())
        self.writer.close()


# --- Lightning -------------------------------------------------------------------------------

def lightning_logger(backend, run_dir, resumed):
    """Lightning's own logger for ``backend`` (False for none), continuing the MLflow run a
    resumed run started."""
    run_dir = Path(run_dir)
    if backend == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger
        saved = run_dir / "tracking.json"
        run_id = runs.read_json(saved)["run_id"] if resumed and saved.exists() else None
        return MLFlowLogger(experiment_name=experiment_name(), run_name=run_dir.resolve().name,
                            tracking_uri=tracking_uri(run_dir), run_id=run_id,
                            artifact_location=artifact_location(run_dir), synchronous=False)
    if backend == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger
        return TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="")
    return False


def tracker_for(logger, run_dir, resumed):
    """On rank 0 of the Lightning stage: Lightning's logger logs the metrics, the kit's tracker
    adds what Lightning does not (system information, lineage, environment, artifacts)."""
    if logger is None:
        return Tracker()
    if type(logger).__name__ == "MLFlowLogger":
        remember_run(run_dir, tracking_uri(run_dir), logger.run_id)
        tracker = LightningTracker(logger, MlflowTracker(logger.experiment, logger.run_id))
    else:
        tracker = LightningTracker(logger, TensorBoardTracker(logger.experiment))
    if not resumed:
        tracker.describe(runs.read_json(Path(run_dir) / "config.json"))
    return tracker


class LightningTracker(Tracker):
    def __init__(self, logger, tracker):
        self.logger, self.tracker = logger, tracker

    def describe(self, config):
        self.tracker.describe(config)

    def log_step(self, record):
        self.logger.log_metrics({k: v for k, v in record.items() if k != "step"}, record["step"])

    def finish(self, run_dir, checkpoint=None):
        self.tracker.finish(run_dir, checkpoint)


# --- what a run records about itself -------------------------------------------------------

def flatten(config, prefix=""):
    """{"args": {"lr": 1}} -> {"args.lr": 1}: MLflow params are flat."""
    flat = {}
    for key, value in config.items():
        if key == "data_manifest":  # a file list, not a parameter: its hash is a tag
            continue
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_tags(config):
    """System information, code version and data lineage of this process."""
    import torch
    tags = {
        "stage": config.get("stage"), "preset": config.get("preset", {}).get("name"),
        "world_size": config.get("world_size"), "device": config.get("device"),
        "device_name": config.get("device_name"), "host": socket.gethostname(),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
        "gpus": torch.cuda.device_count(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "git_commit": git_commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    manifest = config.get("data_manifest")
    if manifest:
        tags["data_dir"], tags["data_manifest_sha256"] = manifest["dir"], manifest["sha256"]
    return {key: value for key, value in tags.items() if value is not None}


def git_commit():
    """The kit's commit, with "+dirty" when files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=KIT_ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=KIT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def installed_packages():
    """``pip freeze``-style list of this environment, to rebuild it later."""
    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"]}, key=str.lower)
    return "\n".join(names) + "\n"


def loss_figure(run_dir):
    """Training and validation loss of a run, as a matplotlib figure (no display needed)."""
    from matplotlib.figure import Figure
    records = runs.read_metrics(run_dir)
    figure = Figure(figsize=(6, 3.5))
    ax = figure.subplots()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training")
    evaluated = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-",
            label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(Path(run_dir).resolve().name)
    ax.legend()
    return figure
