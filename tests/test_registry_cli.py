"""`python -m coursekit registry ...` on the command line: a wrong reference, store or argument is
one line (a model registered and loaded back is in test_registry_roundtrip.py, and a trained
run's in test_tracking.py)."""
import pytest

from coursekit import cli

pytestmark = pytest.mark.unit


@pytest.fixture
def in_process(capsys, monkeypatch):
    """The command line's own entry point run in this process (no second start of torch and
    MLflow per case): returns (exit status, stdout, stderr)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run(*args):
        try:
            status = cli.main(["registry", *map(str, args)])
        except SystemExit as exit_:  # argparse's own errors exit
            status = exit_.code
        return (status, *capsys.readouterr())
    return run


def assert_one_line(status, stderr, start):
    assert status == 2 and "Traceback" not in stderr, stderr
    assert stderr.startswith(start) and stderr.count("\n") == 1, stderr


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """A SQLite MLflow store with its tables and no registered model."""
    from mlflow import MlflowClient
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    assert MlflowClient(uri).search_registered_models() == []
    return uri


@pytest.mark.parametrize("args, start", [
    (["load", "kit-std"], "error: 'kit-std': name a registered model as NAME@ALIAS "
                          "(kit-std@champion) or NAME/VERSION (kit-std/1)"),
    (["load", "kit-std@champion", "--store", "sqlite:///{tmp}/none.db"],
     "error: no MLflow store at {tmp}/none.db (from sqlite:///{tmp}/none.db)"),
    (["register", "{tmp}"], "error: registry register needs --name"),
    (["register", "{tmp}", "--name", "kit"],
     "error: {tmp}/model is not a Hugging Face model directory (no config.json)"),
    (["publish", "kit-std@champion"], "python -m coursekit registry: error: argument action: "
                                      "invalid choice: 'publish' (choose from"),
])
def test_wrong_arguments_are_one_line(in_process, tmp_path, args, start):
    status, _, stderr = in_process(*(arg.format(tmp=tmp_path) for arg in args))
    assert_one_line(status, stderr, start.format(tmp=tmp_path))
    assert not (tmp_path / "none.db").exists()  # a load does not create a store


def test_a_model_that_is_not_registered_is_one_line(in_process, empty_store):
    status, _, stderr = in_process("load", "missing@champion", "--store", empty_store)
    assert_one_line(status, stderr, "error: models:/missing@champion: ")
    assert "missing" in stderr.removeprefix("error: models:/missing@champion: ")
