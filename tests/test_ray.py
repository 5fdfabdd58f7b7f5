"""Ray on a local cluster that the tests share (each script would otherwise start its own, 10 s or
more). A driver waiting for the cluster's nodes outlives a head that stops and starts again on its
port. The head starts while a socket of the test holds the first port the kit chose for its
dashboard: it starts again on another port, and says which. Ray Data embeds the chunks of lesson
09 (solutions/ray_embed.py) as the embedder does alone. Ray Train runs the ddp stage's training
(solutions/ray_train_gpt2.py): 2 workers take the same steps as the ddp stage on 2 processes,
within the tolerance the ddp stage is held to (to the std stage's), and leave the stages' run
directory. Ray Tune searches lesson 07's space (solutions/ray_tune_gpt2.py): ASHA stops the worse
trials at its rungs; under PBT a trial goes on from another's checkpoint with a perturbed learning
rate."""
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (ONE_THREAD, TEN_STEPS, coursekit_with_first_port_taken, free_port,
                      http_get, kit_env, one_ray_at_a_time, run_stage)
from coursekit import KIT_ROOT, presets, rag, raycluster, runs
from solutions import hpo_optuna

pytestmark = pytest.mark.stages


def coursekit(stack, log, env, *args, first_port=None):
    """`python -m coursekit ARGS` writing to the file ``log``, stopped (SIGTERM) with ``stack``
    if still running; its first choice of a free port is ``first_port``, where given."""
    command = (coursekit_with_first_port_taken(first_port, *args) if first_port
               else [sys.executable, "-m", "coursekit", *map(str, args)])
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=KIT_ROOT, env=env, stdout=output,
                                   stderr=subprocess.STDOUT)
    stack.callback(stop, process)
    return process


def stop(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def wait_for_line(log, pattern, process, timeout=420):
    """The first match of ``pattern`` in the file ``log``, where ``process`` writes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if found := re.search(pattern, log.read_text(), re.M):
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {log}: " + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One local Ray head, started as a job's batch file starts it (behind a token in a file of
    mode 0600), with the module's tests as its drivers. A driver that waits for 2 nodes
    (`coursekit ray-nodes`, as the batch files wait) first reaches another head on the same port,
    which then stops, as the kit's head does when another process took one of its ports. The
    module's head starts while a socket of the test holds the first port the kit chooses for its
    dashboard, and a second node joins it. {"env": a driver's environment, "log": the head's
    output, "taken": that port, "waiting": what the waiting driver printed}."""
    folder = tmp_path_factory.mktemp("ray")
    token = folder / "token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    port = free_port()
    env = kit_env({**ONE_THREAD, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                   "RAY_ADDRESS": f"{raycluster.node_address()}:{port}"})
    log = {name: folder / f"{name}.log" for name in ("first", "head", "second", "waiting")}
    with one_ray_at_a_time(tmp_path_factory), contextlib.ExitStack() as stack, \
            socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = coursekit(stack, log["first"], env, "ray-node", "--head", "--port", port,
                          "--cpus", 1)
        waiting = coursekit(stack, log["waiting"], env, "ray-nodes", "--address",
                            env["RAY_ADDRESS"], "--expect", 2, "--timeout", 420)
        wait_for_line(log["waiting"], r"1 of 2 nodes up, waiting", waiting)
        stop(first)
        head = coursekit(stack, log["head"], env, "ray-node", "--head", "--port", port, "--cpus",
                         os.cpu_count(), first_port=taken.getsockname()[1])
        wait_for_line(log["head"], r"^dashboard: ", head)
        second = coursekit(stack, log["second"], env, "ray-node", "--address",
                           env["RAY_ADDRESS"], "--cpus", 1)
        assert waiting.wait(timeout=420) == 0, "\n".join(
            f"--- {name}:\n{path.read_text()[-3000:]}" for name, path in log.items())
        stop(second)
        yield {"env": env, "log": log["head"], "taken": taken.getsockname()[1],
               "waiting": log["waiting"].read_text()}


@pytest.fixture(scope="module")
def ray_env(ray_head):
    return ray_head["env"]


def test_a_driver_waiting_for_its_nodes_outlives_a_head_that_starts_again(ray_head):
    output = ray_head["waiting"]
    assert "its head started again (exit status 1): connecting again" in output, output[-3000:]
    assert re.search(r"^ray cluster at \S+: 2 nodes, a task ran on each", output, re.M), output


def test_a_head_whose_dashboard_port_was_taken_starts_again_on_another(ray_head):
    output = ray_head["log"].read_text()
    assert f"Failed to bind to 127.0.0.1:{ray_head['taken']}" in output, output[-3000:]
    # the last: a busy node can keep a head that bound its ports from starting, and it starts again
    *_, announced = re.findall(r"^dashboard: 127\.0\.0\.1:(\d+) on ", output, re.M)
    assert int(announced) != ray_head["taken"]
    version, token = f"http://127.0.0.1:{announced}/api/version", Path(
        ray_head["env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    assert http_get(version)[0] == 401  # Ray's dashboard, behind the job's token
    assert http_get(version, headers={"Authorization": f"Bearer {token}"})[0] == 200


def test_ray_data_embeds_every_chunk_as_the_embedder_does_alone(kit_embedder, tmp_path, ray_env):
    result = run_stage("ray_embed.py", "--embedder", kit_embedder, "--chunk-tokens", 256,
                       "--workers", 2, "--batch-size", 64, "--out", tmp_path, env=ray_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"ray data: \d+ chunks of 256 tokens embedded by 2 replicas", result.stdout)
    chunks, vectors = rag.load_embeddings(tmp_path)
    assert chunks == rag.chunk(rag.documents(), 256)
    alone = rag.embed(rag.embedder(kit_embedder), [c.text for c in chunks])
    assert vectors.shape == alone.shape and np.allclose(vectors, alone, atol=1e-5)


def test_two_ray_train_workers_train_as_the_ddp_stage_does_on_two_processes(builtin_data, tmp_path,
                                                                          ddp_ten_steps, ray_env):
    result = run_stage("ray_train_gpt2.py", *TEN_STEPS, "--workers", "2", "--data",
                       builtin_data, "--out", tmp_path, env=ray_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ray train: 2 workers, step 10, loss " in result.stdout
    assert result.stdout.count("step 10/10 ") == 1  # rank 0's line, forwarded once
    config = runs.read_json(tmp_path / "config.json")
    assert (config["stage"], config["world_size"], config["grad_accum"]) == ("ray", 2, 1)
    got, expected = runs.read_metrics(tmp_path), runs.read_metrics(ddp_ten_steps)
    assert [r["step"] for r in got] == list(range(1, 11))
    for ray_step, ddp_step in zip(got, expected, strict=True):
        assert ray_step["loss"] == pytest.approx(ddp_step["loss"], abs=1e-4)
        assert ray_step.get("val_loss", 0) == pytest.approx(ddp_step.get("val_loss", 0), abs=1e-4)
    assert runs.load_checkpoint(tmp_path)[0] == 10


TUNE_STEPS, TUNE_RUNG = 6, 2
TINY = presets.get_preset("tiny")
BATCH_UNIT = TINY.micro_batch * TINY.seq_len  # one process's microbatch, as hpo_optuna has it


def within(distribution, value):
    """Whether lesson 07's Optuna distribution could have proposed ``value``."""
    if hasattr(distribution, "choices"):
        return value in distribution.choices
    return distribution.low <= value <= distribution.high


def tune(scheduler, trials, builtin_data, study_dir, env, eval_interval, workers=2):
    result = run_stage("ray_tune_gpt2.py", "--scheduler", scheduler, "--trials", trials,
                       "--workers", workers, "--max-steps", TUNE_STEPS,
                       "--eval-interval", eval_interval,
                       "--data", builtin_data, "--study-dir", study_dir, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr, runs.read_json(study_dir / "best.json")


def trial_logs(study_dir):
    return sorted(study_dir.glob("ray/*/run/train.log"))


def test_asha_stops_the_worse_trials_of_lesson_07s_space_at_its_rungs(builtin_data, tmp_path,
                                                                      ray_env):
    # one trial at a time: each reaches a rung after the ones before it, so that which trials
    # ASHA stops depends on the (seeded) trials alone, not on which of two running ones is faster
    output, best = tune("asha", 4, builtin_data, tmp_path, ray_env, TUNE_RUNG, workers=1)
    assert best["trials"] == 4 and len(trial_logs(tmp_path)) == 4
    # a trial stopped at a rung trained fewer steps than the budget: the study spent less
    assert TUNE_STEPS * 2 <= best["steps_trained"] < TUNE_STEPS * 4, output[-3000:]
    space = hpo_optuna.search_space(TINY, TUNE_STEPS, BATCH_UNIT)
    assert best["best"]["params"].keys() == space.keys()
    assert all(within(space[name], value) for name, value in best["best"]["params"].items())
    assert f"ray tune (asha): 4 trials, {best['steps_trained']} steps trained; best val " in output


def test_pbt_trials_go_on_from_a_better_ones_checkpoint(builtin_data, tmp_path, ray_env):
    output, best = tune("pbt", 2, builtin_data, tmp_path, ray_env, TUNE_STEPS // 2)
    assert best["trials"] == 2 and best["best"]["step"] == TUNE_STEPS
    logs = [log.read_text() for log in trial_logs(tmp_path)]
    # at the perturbation half-way, the worse trial went on from the better one's checkpoint
    assert any(re.search(rf"resumed from .*/ckpt/step_0+{TUNE_STEPS // 2}\b", log)
               for log in logs), logs
    assert re.search(r"Restored on .* from checkpoint: .*trial_\w+_0000[01]_", output)
    defaults = hpo_optuna.default_hyperparameters(TINY, TUNE_STEPS, BATCH_UNIT)
    assert {**best["best"]["params"], "lr": None} == {**defaults, "lr": None}  # lr alone varies
