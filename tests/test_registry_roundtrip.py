"""`python -m coursekit registry register` then `registry load` in fresh processes, as a user runs
them: a tiny model comes back by its alias and completes a prompt exactly as transformers does.
MLflow logs and loads a model in two processes (about a minute), so this is a `slow` test."""
import os
import subprocess
import sys

import pytest
from conftest import kit_env

pytestmark = pytest.mark.slow


def registry_cli(*args):
    """`python -m coursekit registry ARGS` in a fresh process, with no tracking server set."""
    env = {k: v for k, v in kit_env().items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-m", "coursekit", "registry", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


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
    assert gone.returncode == 2 and gone.stderr.startswith(
        f"error: no MLflow store at {tmp_path / 'runs' / 'mlflow.db'}"), gone.stderr
