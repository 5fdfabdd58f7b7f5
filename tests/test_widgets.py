"""The lessons' widgets: moving a control changes what the widget shows, the numbers are
coursekit's arithmetic, the batch-file builder shows the generator's files, and the training
monitor follows a real run to its end."""
import html
import subprocess

import pytest
from conftest import kit_env, stage_command

from coursekit import KIT_ROOT, memory, scaling, widgets

pytestmark = pytest.mark.unit


def controls(box):
    return {control.description: control for control in box.children[:-1]}


def test_the_memory_calculator_follows_its_controls():
    box = widgets.memory_calculator()
    shown = box.children[-1]
    assert "GPT-2 124M" in shown.value and "ddp on 4 rank(s)" in shown.value
    before = shown.value
    controls(box)["strategy"].value = "fsdp"
    assert shown.value != before and "fsdp on 4 rank(s)" in shown.value
    expected = memory.per_rank_bytes(widgets.MODELS["GPT-2 124M"], "fsdp", 4, "bf16-mixed", 8,
                                     1024)["total"]
    assert f"<td>total</td><td style='text-align:right'>{expected / 1e9:,.2f}</td>" in shown.value


def test_a_70b_model_does_not_fit_one_gpu_and_does_with_enough_fsdp_ranks():
    box = widgets.memory_calculator()
    settings = controls(box)
    settings["model"].value = "70B shape"
    settings["micro-batch"].value = 1
    settings["activation checkpointing"].value = True
    settings["ranks"].value = 1
    assert "141 GB too small" in box.children[-1].value
    settings["strategy"].value = "fsdp"
    settings["ranks"].value = 64
    assert "80 GB fits" in box.children[-1].value


def test_an_impossible_choice_is_shown_as_a_message():
    box = widgets.memory_calculator()
    settings = controls(box)
    settings["model"].value = "tiny (course preset)"
    settings["strategy"].value = "pp"
    settings["ranks"].value = 8
    assert "8 pipeline stages: use 1 to 4" in box.children[-1].value


def test_the_batch_calculator_shows_tokens_per_step_and_steps_per_epoch():
    box = widgets.batch_calculator()
    shown = box.children[-1]
    assert "524,288 tokens per step" in shown.value and "19,073 steps per epoch" in shown.value
    settings = controls(box)
    settings["processes"].value = 8
    settings["grad_accum"].value = 1
    assert f"{scaling.tokens_per_step(64, 1, 1024, 8):,} tokens per step" in shown.value
    settings["data tokens"].value = 1_000_000
    assert "<b>1 steps per epoch</b> of 1,000,000 tokens" in shown.value
    settings["micro-batch"].value = 128
    assert "0 steps per epoch" in shown.value


def test_the_scaling_calculator_starts_at_the_serial_fraction_of_the_measured_runs():
    box = widgets.scaling_calculator({1: 10.0, 2: 6.0, 4: 4.0})
    fraction, processes = box.children[:2]
    shown = box.children[-1]
    assert fraction.value == pytest.approx(0.2)  # Karp-Flatt of both measured runs
    assert "<td>4</td><td>4</td><td>2.50</td><td>62%</td><td>20.0%</td>" in shown.value
    assert "limit with any number: <b>5.0</b>" in shown.value and "<img src='data:image/png" in shown.value
    fraction.value = 0.05
    processes.value = 16
    assert f"<b>{scaling.amdahl_speedup(0.05, 16):.1f}</b>" in shown.value
    assert "limit with any number: <b>20.0</b>" in shown.value


def test_the_batchfile_builder_shows_the_committed_file():
    box = widgets.batchfile_builder(site="ci", stage="ddp")
    settings = controls(box)
    settings["nodes"].value = 2
    settings["GPUs per node"].value = 2
    committed = (KIT_ROOT / "batchfiles" / "ci" / "batch-ddp-2n2g.sh").read_text()
    shown = box.children[-1].value
    assert "batchfiles/ci/batch-ddp-2n2g.sh" in shown
    assert "srun" in committed and html.escape(committed) in shown


@pytest.mark.parametrize("stage, nodes, gpus, message", [
    ("std", 2, 1, "the std stage trains on one device"),
    ("pp", 1, 1, "the pp stage needs 2 to 4 processes"),
    ("ddp", 1, 8, "ci has 2 GPU(s) per node, not 8"),
])
def test_the_batchfile_builder_explains_what_cannot_run(stage, nodes, gpus, message):
    box = widgets.batchfile_builder(site="ci", stage=stage)
    settings = controls(box)
    settings["nodes"].value = nodes
    settings["GPUs per node"].value = gpus
    assert message in box.children[-1].value


@pytest.mark.stages
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


def test_the_training_monitor_needs_a_process_or_a_job():
    with pytest.raises(Exception, match="follow a local process or a Slurm job id"):
        widgets.TrainingMonitor("nowhere").follow()
