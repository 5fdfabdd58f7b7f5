"""Experiment tracking, lineage and the model registry, read back through MLflow's and
TensorBoard's own readers (lesson 06)."""
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from conftest import (CreatesFile, coursekit_with_first_port_taken, free_port, http_get, kit_env,
                      mlflow_reported_port, mlflow_server_command, owner_login, run_stage,
                      stage_command, torchrun)
from coursekit import KIT_ROOT, KitError, runs
from helpers import interrupt

pytestmark = pytest.mark.stages
STEPS = 4


def tracked_run(script, out, data, *extra, env=None):
    result = run_stage(script, "--preset", "tiny", "--data", data, "--out", out,
                       "--max-steps", STEPS, "--eval-interval", 2, "--ckpt-interval", 2,
                       "--sample-tokens", 4, *extra, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def mlflow_run(run_dir):
    from mlflow import MlflowClient  # here, not at collection: importing MLflow takes seconds

    saved = json.loads((Path(run_dir) / "tracking.json").read_text())
    client = MlflowClient(saved["tracking_uri"])
    return client, client.get_run(saved["run_id"])


def artifact_paths(client, run_id, path=None):
    found = []
    for entry in client.list_artifacts(run_id, path):
        found += artifact_paths(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return found


@pytest.fixture(scope="module")
def std_tracked(builtin_data, tmp_path_factory):
    """A tracked std run stopped half-way and resumed: (run directory, first MLflow run id)."""
    out = tmp_path_factory.mktemp("tracked") / "std-run"
    tracked_run("train_gpt2_std.py", out, builtin_data, "--track", "mlflow",
                "--max-steps", STEPS // 2)
    first_run_id = mlflow_run(out)[1].info.run_id
    tracked_run("train_gpt2_std.py", out, builtin_data, "--track", "mlflow", "--resume")
    return out, first_run_id


def test_std_run_reads_back_with_params_metric_history_and_artifacts(std_tracked, builtin_data):
    std_tracked, _ = std_tracked
    client, run = mlflow_run(std_tracked)
    assert run.info.status == "FINISHED" and run.info.run_name == "std-run"
    assert run.data.params["args.max_steps"] == str(STEPS // 2)  # parameters of the first start
    assert run.data.params["preset.name"] == "tiny"
    history = client.get_metric_history(run.info.run_id, "loss")
    logged = runs.read_metrics(std_tracked)
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
           [(r["step"], r["loss"]) for r in logged]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [2, 4]
    tags = run.data.tags
    assert tags["stage"] == "std" and tags["world_size"] == "1" and tags["torch"] == torch.__version__
    # the tag names the lineage record of config.json, whose files are the shards' real digests
    lineage = json.loads((std_tracked / "config.json").read_text())["data_manifest"]
    assert tags["data_manifest_sha256"] == lineage["sha256"]
    assert lineage["files"] == {shard.name: hashlib.sha256(shard.read_bytes()).hexdigest()
                                for shard in sorted(builtin_data.glob("*.npy"))}
    assert len(tags["git_commit"].split("+")[0]) == 40
    artifacts = artifact_paths(client, run.info.run_id)
    assert {"config.json", "metrics.jsonl", "sample.txt", "loss.png",
            "environment/requirements.txt",
            f"checkpoint/step_{STEPS:08d}/tensors.safetensors"} <= set(artifacts)
    packages = Path(client.download_artifacts(run.info.run_id, "environment/requirements.txt"))
    assert f"torch=={torch.__version__}" in packages.read_text().split()


def test_resumed_run_continues_the_same_mlflow_run(std_tracked):
    out, first_run_id = std_tracked
    client, run = mlflow_run(out)
    assert run.info.run_id == first_run_id and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(first_run_id, "loss")) == \
           list(range(1, STEPS + 1))


def test_lightning_stage_logs_through_lightnings_mlflow_logger(builtin_data, tmp_path):
    out = tmp_path / "lit-run"
    tracked_run("train_gpt2_lit.py", out, builtin_data, "--track", "mlflow")
    client, run = mlflow_run(out)
    assert run.data.tags["stage"] == "lit"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == \
           list(range(1, STEPS + 1))
    assert f"checkpoint/step_{STEPS:08d}.ckpt" in artifact_paths(client, run.info.run_id)


def test_tensorboard_event_files_hold_every_step(builtin_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "tb-run"
    tracked_run("train_gpt2_std.py", out, builtin_data, "--track", "tensorboard")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = runs.read_metrics(out)
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")] == \
           [(r["step"], r["loss"]) for r in logged]


@pytest.fixture(scope="module")
def served(builtin_data, tmp_path_factory):
    """The kit's MLflow server, and a run that logs to it over HTTP with its owner's password.
    The server stops while the run trains, and comes back (the same port, store and password)
    before the run is resumed. Yields what the tests read while it is back up."""
    folder = tmp_path_factory.mktemp("served")
    port, server = start_server(folder)  # at a port the kit chooses
    url = f"http://127.0.0.1:{port}"
    owner = owner_login(folder / "state")
    env = kit_env({"MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": owner[0],
                   "MLFLOW_TRACKING_PASSWORD": owner[1]})
    out = folder / "served-run"
    args = ["--preset", "tiny", "--data", builtin_data, "--out", out, "--max-steps", SERVED_STEPS,
            "--eval-interval", 6, "--eval-steps", 2, "--ckpt-interval", 6, "--sample-tokens", 0,
            "--track", "mlflow"]
    try:
        run = interrupt.start(stage_command("train_gpt2_std.py", *args), env)
        lines = interrupt.read_until(run, f"step 2/{SERVED_STEPS} ")
        run.send_signal(signal.SIGSTOP)  # while the server goes away
        stop_server(server)
        run.send_signal(signal.SIGCONT)
        status, output = interrupt.finish(run, lines)
        metrics = runs.read_metrics(out)
        _, server = start_server(folder, port)  # the same port, given
        resumed = run_stage("train_gpt2_std.py", *args, "--resume", env=env)
        yield {"folder": folder, "url": url, "port": port, "owner": owner, "out": out,
               "interrupted": (status, output, metrics), "resumed": resumed, "server": server}
    finally:
        stop_server(server)


SERVED_STEPS = 12


def start_server(folder, port=None, command=mlflow_server_command):
    """The kit's MLflow server on ``port``, or on the one it chooses; its state, store, artifacts
    and log in ``folder``. (port, process) once it answers at the port it reported."""
    log = folder / "server.log"
    written = log.stat().st_size if log.exists() else 0
    with open(log, "a") as output:
        server = subprocess.Popen(command(
            folder / "state", "--store", f"sqlite:///{folder / 'server.db'}", "--artifacts",
            folder / "server-artifacts", *(["--port", port] if port else [])), stdout=output,
            stderr=subprocess.STDOUT, env=kit_env(), start_new_session=True)
    port = mlflow_reported_port(log, written, server)
    wait_for(f"http://127.0.0.1:{port}/health", server)
    return port, server


def stop_server(server):
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers, by PID
        server.wait(timeout=60)


def logged_run(served):
    """The served run as the server has it (MLflow's REST API, with the owner's password)."""
    run_id = json.loads((served["out"] / "tracking.json").read_text())["run_id"]
    status, body = http_get(f"{served['url']}/api/2.0/mlflow/runs/get?run_id={run_id}",
                            served["owner"])
    assert status == 200
    return json.loads(body)["run"]


def test_the_kits_mlflow_server_lets_in_its_owner_alone(served):
    """Another user of the node reaches 127.0.0.1 too: without the owner's password (kept where
    only the owner reads it) every request is refused; with it, a run logs over HTTP."""
    url, state, (user, password) = served["url"], served["folder"] / "state", served["owner"]
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "password").stat().st_mode) == 0o600
    runs_of_nobody = f"{url}/api/2.0/mlflow/experiments/search?max_results=5"
    for login in (None, (user, "guessed"), ("someone-else", password)):
        assert http_get(runs_of_nobody, login)[0] == 401, login
        assert http_get(f"{url}/", login)[0] == 401, login  # nor the UI
    run = logged_run(served)
    assert run["info"]["status"] == "FINISHED"
    metrics = {m["key"]: m for m in run["data"]["metrics"]}
    assert metrics["loss"]["step"] == SERVED_STEPS
    assert metrics["loss"]["value"] == pytest.approx(runs.read_metrics(served["out"])[-1]["loss"])
    assert any((served["folder"] / "server-artifacts").rglob("loss.png"))  # uploaded over HTTP
    log = (served["folder"] / "server.log").read_text()
    assert f"{served['port']} (127.0.0.1 only), for {user} alone" in log and password not in log
    # and no job runner (MLflow's Huey consumers) among the server's processes
    processes = [" ".join(child.cmdline())
                 for child in psutil.Process(served["server"].pid).children(recursive=True)]
    assert any("uvicorn" in command or "mlflow" in command for command in processes), processes
    assert not any("huey" in command for command in processes), processes


def test_a_tracking_server_that_goes_away_costs_no_step(served):
    """The server stops while the run trains: the run ends all the same, with one warning, and
    metrics.jsonl has every step. Run again with --resume once the server is back, and its
    MLflow run gets the steps it missed."""
    status, output, metrics = served["interrupted"]
    assert status == 0, output[-3000:]
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: --track mlflow: the tracking store {served['url']} failed: "), output[-3000:]
    assert [r["step"] for r in metrics] == list(range(1, SERVED_STEPS + 1))
    resumed = served["resumed"]
    assert resumed.returncode == 0 and "warning" not in resumed.stderr, resumed.stderr[-3000:]
    run_id = logged_run(served)["info"]["run_id"]
    status, body = http_get(f"{served['url']}/api/2.0/mlflow/metrics/get-history?run_id={run_id}"
                            "&metric_key=loss&max_results=100", served["owner"])
    assert sorted(m["step"] for m in json.loads(body)["metrics"]) == \
           list(range(1, SERVED_STEPS + 1))


def test_the_mlflow_servers_state_must_be_private(tmp_path):
    state = tmp_path / "shared"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    result = subprocess.run(mlflow_server_command(state), capture_output=True, text=True,
                            env=kit_env())
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {state} must be yours and closed to others (mode "
                                    "755"), result.stderr
    assert not (state / "password").exists()


def test_a_port_taken_before_mlflow_binds_it_is_replaced_by_another(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        def first_choice_taken(state, *args):
            return coursekit_with_first_port_taken(port, "mlflow-server", "--state", state, *args)

        reported, server = start_server(tmp_path, command=first_choice_taken)
        try:
            assert reported != port
            log = (tmp_path / "server.log").read_text()
            assert f"error while attempting to bind on address ('127.0.0.1', {port})" in log
            assert http_get(f"http://127.0.0.1:{reported}/health")[0] == 200
        finally:
            stop_server(server)


def wait_for(url, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "mlflow server exited"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout} s")


def test_registered_model_loads_back_by_alias(std_tracked, tmp_path):
    std_tracked, _ = std_tracked
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model_dir = tmp_path / "hf"
    export = subprocess.run([sys.executable, "-m", "coursekit", "export-hf", str(std_tracked),
                             str(model_dir)], capture_output=True, text=True, env=kit_env())
    assert export.returncode == 0, export.stderr
    register = subprocess.run([sys.executable, "-m", "coursekit", "registry", "register",
                               str(std_tracked), "--name", "kit-std", "--alias", "champion",
                               "--model-dir", str(model_dir)], capture_output=True, text=True,
                              env=kit_env())
    assert register.returncode == 0, register.stderr
    client, run = mlflow_run(std_tracked)
    version = client.get_model_version_by_alias("kit-std", "champion")
    assert version.run_id == run.info.run_id  # the registry leads back to the tracked run

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer("The", return_tensors="pt").input_ids
    direct = model.generate(ids, max_new_tokens=5, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(direct[0, ids.shape[1]:], skip_special_tokens=True)

    # Someone who can write the store replaces its copy of the model's code, and then its
    # weights with a pickle: loading runs neither, and refuses the pickle.
    from coursekit import registry
    stored = std_tracked.parent / "mlartifacts"  # the SQLite store's artifacts (tracking.py)
    marker = tmp_path / "ran"
    code = list(stored.rglob("*.py"))
    assert code  # MLflow keeps the model's code (coursekit/mlflow_model.py) with its files
    [weights] = stored.rglob("model.safetensors")
    originals = {path: path.read_bytes() for path in [*code, weights]}
    pickle = weights.with_name("pytorch_model.bin")
    try:
        for path in code:
            path.write_text(f"open({str(marker)!r}, 'w')\n")
        loaded = registry.load("kit-std@champion", client.tracking_uri)
        assert loaded.predict(["The"], params={"max_new_tokens": 5}) == [expected]
        weights.unlink()
        torch.save({"weights": CreatesFile(marker)}, pickle)
        with pytest.raises(KitError, match="holds no safetensors weights"):
            registry.load("kit-std@champion", client.tracking_uri)
        assert not marker.exists()
    finally:  # the module's tracked run, as the other tests find it
        pickle.unlink(missing_ok=True)
        for path, content in originals.items():
            path.write_bytes(content)


def test_verify_data_names_a_changed_shard(std_tracked, builtin_data, tmp_path):
    std_tracked, _ = std_tracked
    verify = [sys.executable, "-m", "coursekit", "verify-data", str(std_tracked)]
    same = subprocess.run(verify, capture_output=True, text=True, env=kit_env())
    assert same.returncode == 0 and "matches the manifest" in same.stdout, same.stderr
    copy = tmp_path / "data"
    copy.mkdir()
    for path in builtin_data.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    shard = copy / "val_000000.npy"
    tokens = bytearray(shard.read_bytes())
    tokens[-1] ^= 1  # one token changed
    shard.write_bytes(bytes(tokens))
    changed = subprocess.run([*verify, "--data", str(copy)], capture_output=True, text=True,
                             env=kit_env())
    assert changed.returncode == 1
    assert changed.stderr.strip() == (f"{copy} differs from what {std_tracked} trained on: "
                                      "val_000000.npy changed")


def test_unknown_tracker_gets_one_line(builtin_data, tmp_path):
    result = run_stage("train_gpt2_std.py", "--data", builtin_data, "--out", tmp_path,
                       "--track", "wandb")
    assert result.returncode == 2
    assert "argument --track: invalid choice: 'wandb' (choose from 'none', 'mlflow', 'tensorboard')" \
        in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr


def test_only_rank_0_of_a_ddp_run_logs(builtin_data, tmp_path):
    out = tmp_path / "ddp-run"
    torchrun(2, KIT_ROOT / "solutions" / "train_gpt2_ddp.py", "--preset", "tiny", "--device", "cpu",
             "--data", builtin_data, "--out", out, "--max-steps", "2", "--sample-tokens", "0",
             "--track", "mlflow")
    client, run = mlflow_run(out)
    assert run.data.tags["world_size"] == "2"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2


def test_unreachable_tracking_server_gets_one_line(builtin_data, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_stage("train_gpt2_std.py", "--data", builtin_data, "--out", tmp_path / "run",
                       "--max-steps", 1, "--track", "mlflow",
                       env=kit_env({"MLFLOW_TRACKING_URI": url,
                                    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --track mlflow: the tracking store {url} failed: ")
    assert "Traceback" not in result.stderr
