"""`python -m coursekit registry ...` on the command line: a registered model loads back by its
alias and completes a prompt exactly as the model itself does; a wrong reference, store or
argument is one line (the register-and-load round trip of a trained run is in test_tracking.py)."""
import os
import subprocess
import sys

import pytest
from conftest import kit_env

from coursekit import cli

pytestmark = pytest.mark.unit


def registry_cli(*args):
    """`python -m coursekit registry ARGS` in a fresh process, with no tracking server set."""
    env = {k: v for k, v in kit_env().items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-m", "coursekit", "registry", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


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


def tiny_model(out):
    """A random one-layer GPT-2 with GPT-2's tokenizer, as a Hugging Face model directory."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from coursekit import hfexport
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(out)
    hfexport.save_tokenizer(hfexport.tokenizer_cache(), 64, out)
    return out


def greedy_completion(model_dir, prompt, tokens):
    """What the model itself continues ``prompt`` with, through transformers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow  # MLflow logs and loads a model in two fresh processes: about a minute
def test_a_registered_model_loads_back_by_alias(tmp_path):
    model_dir = tiny_model(tmp_path / "model")
    run_dir = tmp_path / "runs" / "tiny"  # untracked: the model goes into runs/mlflow.db
    run_dir.mkdir(parents=True)
    register = registry_cli("register", run_dir, "--name", "kit-tiny", "--alias", "champion",
                            "--model-dir", model_dir)
    assert register.returncode == 0, register.stderr
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    loaded = registry_cli("load", "kit-tiny@champion", "--store", store, "--prompt", "The cat")
    assert loaded.returncode == 0, loaded.stderr
    # the command prints the prompt and the 16 tokens the model's greedy search adds to it
    assert loaded.stdout == f"The cat{greedy_completion(model_dir, 'The cat', 16)}\n"
    os.remove(tmp_path / "runs" / "mlflow.db")
    gone = registry_cli("load", "kit-tiny@champion", "--store", store)
    assert_one_line(gone.returncode, gone.stderr,
                    f"error: no MLflow store at {tmp_path / 'runs' / 'mlflow.db'}")
