"""The hpo stage (solutions/hpo_optuna.py): workers sharing one journal, pruning, the best trial
against the preset's defaults, results on disk, a re-run continuing the study, and an interrupted
trial queued and resumed from its checkpoint."""
import importlib.util
import os
import signal
import shutil
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

from conftest import held_pythonpath
from coursekit import KIT_ROOT, data, presets, runs

SCRIPT = KIT_ROOT / "solutions" / "hpo_optuna.py"
TRIALS = 6
STEPS = 18
BUDGET = ["--max-steps", str(STEPS), "--eval-interval", "3", "--train-args", "--eval-steps 2"]


def load_script():
    spec = importlib.util.spec_from_file_location("hpo_optuna", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hpo(*args, **popen):
    command = [sys.executable, str(SCRIPT), "--data", str(KIT_ROOT / "data" / "builtin"), *args]
    if popen:
        return subprocess.Popen(command, cwd=KIT_ROOT, text=True, **popen)
    return subprocess.run(command, cwd=KIT_ROOT, capture_output=True, text=True, timeout=900)


def load_trials(study_dir, name="hpo-tiny"):
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study_dir / "journal.log")))
    return optuna.load_study(study_name=name, storage=storage).get_trials()


@pytest.fixture(scope="module")
def builtin():
    if not (KIT_ROOT / "data" / "builtin" / "meta.json").exists():
        data.prepare_builtin(KIT_ROOT / "data" / "builtin", progress=False)


@pytest.fixture(scope="module")
def study(builtin, tmp_path_factory):
    """A TPE study with Hyperband pruning, 2 local workers, and the defaults' baseline run."""
    study_dir = tmp_path_factory.mktemp("hpo") / "study"
    result = hpo("--study-dir", str(study_dir), "--trials", str(TRIALS), "--workers", "2",
                 "--baseline", *BUDGET)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return study_dir, result.stdout


@pytest.mark.stages
@pytest.mark.slow
def test_two_workers_share_one_journal_and_prune(study):
    study_dir, _ = study
    trials = load_trials(study_dir)
    # two workers may both ask for the last trial: the later ask is failed at once, as surplus
    counted = [t for t in trials if not t.user_attrs.get("surplus")]
    assert len(counted) == TRIALS and len(trials) <= TRIALS + 1
    assert all(t.state == TrialState.FAIL for t in trials if t not in counted)
    assert [t.number for t in trials] == list(range(len(trials)))
    assert {t.user_attrs["worker"] for t in counted} == {0, 1}
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in counted)
    pruned = [t for t in counted if t.state == TrialState.PRUNED]
    assert pruned and len(pruned) < len(counted)
    for trial in pruned:  # stopped early, at a validation the pruner saw; its checkpoint removed
        steps = [r["step"] for r in runs.read_metrics(trial.user_attrs["run_dir"])]
        assert max(trial.intermediate_values) < STEPS and max(steps) < STEPS
        assert not runs.checkpoint_dir(trial.user_attrs["run_dir"]).exists()
    run_dirs = {t.user_attrs["run_dir"] for t in counted}
    assert len(run_dirs) == len(counted)


@pytest.mark.stages
@pytest.mark.slow
def test_best_trial_beats_the_presets_defaults(study):
    study_dir, stdout = study
    trials = load_trials(study_dir)
    best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    # the baseline's loss as its own trainer wrote it, with the same budget and seed
    baseline = runs.read_metrics(study_dir / "baseline")[-1]
    baseline_config = runs.read_json(study_dir / "baseline" / "config.json")["args"]
    assert baseline["step"] == STEPS and baseline_config["lr"] == presets.get_preset("tiny").lr
    assert best.value < baseline["val_loss"], stdout[-3000:]
    final = runs.read_metrics(best.user_attrs["run_dir"])[-1]
    assert final["step"] == STEPS and final["val_loss"] == pytest.approx(best.value)


@pytest.mark.stages
@pytest.mark.slow
def test_results_are_written(study):
    study_dir, stdout = study
    trials = load_trials(study_dir)
    summary = runs.read_json(study_dir / "best.json")
    best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert summary["best"]["number"] == best.number and summary["trials"] == len(trials)
    assert summary["states"]["pruned"] == sum(t.state == TrialState.PRUNED for t in trials)
    rows = (study_dir / "trials.csv").read_text().strip().splitlines()
    assert len(rows) == len(trials) + 1 and "params_lr" in rows[0]
    for name in ("history", "importance", "intermediate", "parallel"):
        image = (study_dir / "plots" / f"{name}.png").read_bytes()
        assert image.startswith(b"\x89PNG") and len(image) > 5000, name
    assert f"best: trial {best.number}, val {best.value:.4f}" in stdout


@pytest.mark.stages
@pytest.mark.slow
def test_running_again_continues_the_study(study, tmp_path):
    study_dir = tmp_path / "study"  # a copy: the module's study is the other tests' as it ended
    shutil.copytree(study[0], study_dir)
    before = load_trials(study_dir)
    result = hpo("--study-dir", str(study_dir), "--trials", str(len(before) + 1), *BUDGET)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    after = load_trials(study_dir)
    assert len(after) == len(before) + 1
    assert [(t.number, t.params, t.value) for t in after[:len(before)]] == \
           [(t.number, t.params, t.value) for t in before]
    assert "baseline" not in result.stdout  # the defaults' run is not trained again


@pytest.mark.stages
@pytest.mark.slow
def test_interrupted_trial_is_queued_and_resumed_from_its_checkpoint(builtin, tmp_path):
    """SIGTERM (Slurm's requeue or time limit): the trial checkpoints, waits in the study, and the
    next run resumes it; its metrics continue where they stopped."""
    study_dir, budget = tmp_path / "study", one_trial()
    driver = hpo("--study-dir", str(study_dir), *budget, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, env=held_at(HOLD_AT))
    wait_for_held_step(driver, study_dir / "trials" / "0000")
    driver.send_signal(signal.SIGTERM)
    output = driver.communicate(timeout=300)[0]
    assert driver.returncode == 0, output
    assert "SIGTERM received: the running trial is queued" in output
    first, queued = load_trials(study_dir)
    assert first.state == TrialState.FAIL and first.user_attrs["interrupted"]
    assert queued.state == TrialState.WAITING
    assert HOLD_AT <= runs.read_metrics(study_dir / "trials" / "0000")[-1]["step"] < TRIAL_STEPS

    result = hpo("--study-dir", str(study_dir), *budget)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed = load_trials(study_dir)[1]
    assert resumed.state == TrialState.COMPLETE and resumed.params == first.params
    assert resumed.user_attrs["run_dir"] == str(study_dir / "trials" / "0000")
    steps = [r["step"] for r in runs.read_metrics(study_dir / "trials" / "0000")]
    assert steps == list(range(1, TRIAL_STEPS + 1))  # resumed from its checkpoint, not from step 1
    log = (study_dir / "trials" / "0000" / "train.log").read_text()
    assert log.count(f"step 1/{TRIAL_STEPS} ") == 1


@pytest.mark.stages
@pytest.mark.slow
def test_a_trial_whose_worker_is_killed_is_queued_again_after_its_lease(builtin, tmp_path):
    """SIGKILL to a worker (the out-of-memory killer; a node that died) tells no one: its trial
    stays RUNNING in the journal. Its trainer stops with it, checkpointed. Once the trial's
    heartbeat is older than --lease, another worker fails it and queues it again, and resumes it
    from its checkpoint; the study counts one trial, as --trials says."""
    study_dir, lease = tmp_path / "study", 4
    budget = one_trial("--lease", str(lease))
    driver = hpo("--study-dir", str(study_dir), *budget, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, env=held_at(HOLD_AT))
    wait_for_held_step(driver, study_dir / "trials" / "0000")
    driver.kill()
    driver.wait()
    [lost] = load_trials(study_dir)
    assert lost.state == TrialState.RUNNING
    # another worker comes by while the lost one's heartbeat is late, but not yet past the lease
    heartbeat_age = load_script().heartbeat_age
    while heartbeat_age(load_trials(study_dir)[0]) <= lease / 2:
        time.sleep(0.1)
    result = hpo("--study-dir", str(study_dir), *budget)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "worker 0 | trial 0 lost its worker (no heartbeat for " in result.stdout
    first, resumed = load_trials(study_dir)
    assert first.state == TrialState.FAIL and first.user_attrs["interrupted"]
    assert resumed.state == TrialState.COMPLETE and resumed.params == first.params
    steps = [r["step"] for r in runs.read_metrics(study_dir / "trials" / "0000")]
    assert steps == list(range(1, TRIAL_STEPS + 1))  # resumed from its checkpoint
    log = (study_dir / "trials" / "0000" / "train.log").read_text()
    assert log.count(f"step 1/{TRIAL_STEPS} ") == 1 and "SIGTERM received: checkpoint saved" in log


# The step after which the trainer is stopped: after the checkpoint of step 2, before its last
# step. It holds there until the signal reaches it (tests/slurm/hold/sitecustomize.py, as the
# Slurm tests' jobs do), so the test cannot lose a race with a fast trainer.
HOLD_AT = 4
#: The steps of the one trial that is stopped and resumed: some are left after the stop
TRIAL_STEPS = 2 * HOLD_AT


def one_trial(*options):
    """A study of one unpruned trial, checkpointed every 2 steps."""
    return ["--trials", "1", "--max-steps", str(TRIAL_STEPS), "--eval-interval", str(HOLD_AT),
            "--pruner", "none", *options, "--train-args", "--eval-steps 2 --ckpt-interval 2"]


def held_at(step):
    """The environment of a driver whose trainers hold after the line of ``step`` until a stop
    signal reaches them (the driver itself prints no step line)."""
    return {**os.environ, "PYTHONPATH": held_pythonpath(), "KIT_HOLD_AT_STEP": str(step)}


def wait_for_held_step(driver, run_dir):
    """Wait until the trial's trainer holds after the line of step HOLD_AT. It writes to a log
    file, not a pipe that could be read line by line, so the log is looked at every 0.2 s: how
    often decides only how soon the test goes on, since the trainer waits for its signal."""
    log = run_dir / "train.log"
    while not (log.exists() and f"step {HOLD_AT}/" in log.read_text()):
        assert driver.poll() is None, driver.stdout.read()
        time.sleep(0.2)


def allowed(distribution, value):
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return value in distribution.choices
    return distribution.low <= value <= distribution.high


@pytest.mark.unit
def test_the_grid_lies_inside_the_search_space():
    """The grid sampler's points must be values the trial's distributions allow."""
    hpo_optuna = load_script()
    for name in presets.PRESETS:
        preset = presets.get_preset(name)
        for processes in (1, 2, 4, 8):
            unit = preset.micro_batch * preset.seq_len * processes
            space = hpo_optuna.search_space(preset, 300, unit)
            points = hpo_optuna.grid(preset, 300, unit)
            defaults = hpo_optuna.default_hyperparameters(preset, 300, unit)
            assert set(points) == set(space) == set(defaults)
            for param, values in points.items():
                assert all(allowed(space[param], v) for v in [*values, defaults[param]]), \
                    (name, param, values)
            assert all(b % unit == 0 for b in space["batch_tokens"].choices)


@pytest.mark.unit
def test_a_smaller_micro_batch_reaches_every_trial_and_keeps_the_batch_choices(builtin, tmp_path,
                                                                               monkeypatch):
    """A 40 GB GPU holds half of GPT-2's micro-batch (the batch files pass --micro-batch 32):
    every trial trains with it, and the study's batch sizes stay multiples of the smaller unit."""
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    hpo_optuna = load_script()
    args = hpo_optuna.parse_args(["--study-dir", str(tmp_path), "--micro-batch", "2",
                                  "--data", str(KIT_ROOT / "data" / "builtin")])
    assert args.batch_unit == 2 * presets.get_preset("tiny").seq_len
    command = hpo_optuna.trainer_command(args, {"lr": 1e-3}, tmp_path / "trial")
    assert command[command.index("--micro-batch") + 1] == "2"


@pytest.mark.unit
@pytest.mark.parametrize("args, message", [
    (["--max-steps", "10", "--eval-interval", "20"],
     "--eval-interval 20 is more than --max-steps 10"),
    (["--nodes", "2"], "--nodes 2 starts trials with srun: run it inside a Slurm job"),
    (["--sampler", "bayes"], "argument --sampler: invalid choice: 'bayes'"),
    (["--trials", "0"], "argument --trials: expected a positive integer, got 0"),
    (["--lease", "0"], "argument --lease: expected a positive number, got 0"),
])
def test_bad_arguments_get_one_line(builtin, tmp_path, monkeypatch, capsys, args, message):
    """The script's own argument parsing, in this process (the first thing main() does)."""
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as stopped:
        load_script().parse_args(["--study-dir", str(tmp_path), *args])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and message in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.unit
def test_a_storage_that_cannot_be_opened_stops_the_script_with_one_line(builtin, tmp_path):
    """Found when a worker opens the study, after the arguments: a whole process says it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, str(SCRIPT), "--study-dir", str(tmp_path),
                             "--storage", "nosuchdb://x"],
                            cwd=KIT_ROOT, capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "--storage 'nosuchdb://x'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
