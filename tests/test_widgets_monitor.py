"""The training monitor widget follows a real training run to its end. It trains, so it is a
`stages` test, apart from the unit tests of the other widgets in test_widgets.py."""
import subprocess

import pytest
from conftest import kit_env, stage_command

from coursekit import KIT_ROOT, widgets

pytestmark = pytest.mark.stages


def test_the_training_monitor_follows_a_run_to_its_last_step(builtin_data, tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(stage_command(
        "train_gpt2_std.py", "--preset", "tiny", "--data", builtin_data, "--out", run_dir,
        "--max-steps", 6, "--eval-interval", 3, "--eval-steps", 1, "--sample-tokens", 0),
        env=kit_env(), cwd=KIT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    monitor = widgets.TrainingMonitor(run_dir)
    assert monitor.follow(process, interval=0.2) == 0, process.stderr.read().decode()[-2000:]
    assert (monitor.progress.value, monitor.progress.max) == (6, 6)
    assert monitor.status.value.startswith("step 6 of 6: loss ")
    assert len(monitor.records) == 6 and "<img src='data:image/png" in monitor.plots.value
