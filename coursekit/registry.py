"""The MLflow model registry: register a run's Hugging Face model under a name and an alias
("champion", "staging", ...), and load it back by that alias from any machine that sees the store.

    python -m coursekit registry register RUN_DIR --name kit-lora --alias champion
    python -m coursekit registry load kit-lora@champion --prompt "..."

The model is logged into the run's own MLflow run when it was tracked (``--track mlflow``), so
the registry entry leads back to its parameters, metrics and data manifest.
"""
import contextlib
import os
import tempfile
from pathlib import Path

from coursekit import KIT_ROOT, KitError, runs, tracking

MODEL_CODE = Path(__file__).with_name("mlflow_model.py")


def default_store():
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(KIT_ROOT / 'runs' / 'mlflow.db').resolve()}"


@contextlib.contextmanager
def using_store(uri):
    """Point MLflow's module-level API at ``uri`` for a while. ``mlflow.set_tracking_uri`` also
    exports MLFLOW_TRACKING_URI to child processes; both are put back afterwards, so a notebook's
    later training runs still log where they would have."""
    import mlflow
    previous_uri, previous_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous_uri)
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env


def register(run_dir, name, alias, model_dir=None):
    """Log RUN_DIR's model (RUN_DIR/model unless ``model_dir``) as an MLflow model, register it
    as a new version of ``name`` and point ``alias`` at it; returns (store URI, version)."""
    run_dir = Path(run_dir)
    model_dir = Path(model_dir) if model_dir else run_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise KitError(f"{model_dir} is not a Hugging Face model directory (no config.json): "
                       "fine-tune with solutions/finetune_lora.py or export a run with "
                       "`python -m coursekit export-hf`")
    import mlflow  # seconds to import: after the checks
    from mlflow.models import infer_signature
    saved = run_dir / "tracking.json"
    tracked = runs.read_json(saved) if saved.exists() else None
    uri = tracked["tracking_uri"] if tracked else tracking.tracking_uri(run_dir)
    tracking.make_store_private(uri, None if tracked else tracking.artifact_folder(run_dir))
    client = mlflow.MlflowClient(uri)
    run_id = tracked["run_id"] if tracked else client.create_run(
        tracking.experiment_id(client, run_dir), run_name=run_dir.resolve().name).info.run_id
    with using_store(uri), mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model", python_model=str(MODEL_CODE), artifacts={"model": str(model_dir)},
            registered_model_name=name, pip_requirements=["torch", "transformers"],
            signature=infer_signature(["a prompt"], ["a completion"],
                                      params={"max_new_tokens": 16}))
    version = info.registered_model_version
    client.set_registered_model_alias(name, alias, version)
    return uri, version


def load(reference, store=None):
    """The model registered as ``NAME@ALIAS`` (or ``NAME/VERSION``), with ``predict(prompts)``.
    Its files are downloaded and read as data (coursekit.mlflow_model.Completer): nothing in the
    store runs, so a store that someone else could write cannot make you run their code."""
    if "@" not in reference and "/" not in reference:
        raise KitError(f"{reference!r}: name a registered model as NAME@ALIAS (kit-std@champion) "
                       "or NAME/VERSION (kit-std/1)")
    store = store or default_store()
    check_store_exists(store)
    import mlflow
    from mlflow.exceptions import MlflowException

    from coursekit.mlflow_model import Completer
    with tempfile.TemporaryDirectory() as scratch:
        try:
            with using_store(store):
                files = Path(mlflow.artifacts.download_artifacts(f"models:/{reference}",
                                                                 dst_path=scratch))
        except MlflowException as err:
            raise KitError(f"models:/{reference}: {' '.join(str(err).split())[:300]}") from None
        model_dir = hugging_face_directory(files)
        if model_dir is None or not any(model_dir.glob("*.safetensors")):
            raise KitError(f"models:/{reference} holds no safetensors weights: the kit loads "
                           "weights only in that format (others can run code when loaded)")
        return Completer(model_dir)


def hugging_face_directory(files):
    """Where the downloaded model ``files`` keep the Hugging Face directory, as their MLmodel
    file (YAML, read as data) says; None if that is not a folder among them."""
    import yaml
    flavor = yaml.safe_load((files / "MLmodel").read_text())["flavors"]["python_function"]
    folder = (files / flavor["artifacts"]["model"]["path"]).resolve()
    return folder if folder.is_dir() and folder.is_relative_to(files.resolve()) else None


def check_store_exists(uri):
    """A SQLite store must be there already: MLflow would create an empty one (with a screenful
    of log lines) and then report the model missing."""
    path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if path is not None and not path.is_file():
        raise KitError(f"no MLflow store at {path} (from {uri}): register a model there first "
                       "(`python -m coursekit registry register`), or pass --store, or set "
                       "MLFLOW_TRACKING_URI")
