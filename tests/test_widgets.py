"""The lessons' widgets: moving a control changes what the widget shows, the numbers shown are
worked by hand or counted on the real model, and the batch-file builder shows the committed files
(the training monitor, which trains, is in test_widgets_monitor.py)."""
import html
import re

import pytest
import torch

from coursekit import KIT_ROOT, presets, stages, widgets

pytestmark = pytest.mark.unit


def controls(box):
    return {control.description: control for control in box.children[:-1]}


def shown_gb(text):
    """{part: GB} of the memory calculator's table."""
    return {part: float(gb) for part, gb in
            re.findall(r"<td>(\w+)</td><td style='text-align:right'>([\d.]+)</td>", text)}


def gpt2_parameters():
    """GPT-2 small's parameter count, from the std stage's model on the meta device."""
    std, shape = stages.load("std"), presets.get_preset("gpt2-124m")
    with torch.device("meta"):
        model = std.GPT(std.GPTConfig(vocab_size=shape.vocab_size, block_size=shape.seq_len,
                                      n_layer=shape.n_layer, n_head=shape.n_head,
                                      n_embd=shape.n_embd))
    return sum(p.numel() for p in model.parameters())


def test_the_memory_calculator_follows_its_controls():
    box = widgets.memory_calculator()
    shown, settings = box.children[-1], controls(box)
    n = gpt2_parameters()
    assert f"GPT-2 124M</b>: {n / 1e6:.0f} M parameters, ddp on 4 rank(s)" in shown.value
    settings["precision"].value = "fp32"
    settings["ranks"].value = 1
    # fp32 AdamW: 4 bytes of weight, 4 of gradient, 4 + 4 of moments per parameter
    one = shown_gb(shown.value)
    assert (one["params"], one["grads"], one["optimizer"]) == \
           (round(4 * n / 1e9, 2), round(4 * n / 1e9, 2), round(8 * n / 1e9, 2))
    settings["strategy"].value = "fsdp"
    settings["ranks"].value = 4
    assert "fsdp on 4 rank(s)" in shown.value
    four = shown_gb(shown.value)
    assert (four["params"], four["grads"], four["optimizer"]) == \
           (round(n / 1e9, 2), round(n / 1e9, 2), round(2 * n / 1e9, 2))
    assert four["activations"] == one["activations"]  # each rank runs the same micro-batch
    parts = sum(gb for part, gb in four.items() if part != "total")
    assert four["total"] == pytest.approx(parts, abs=0.02)  # each shown rounded to 0.01


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
    assert "<b>524,288 tokens per step</b>: 64 samples x 1 accumulation step(s) x 8 " \
           "process(es) = 512 samples of 1,024 tokens" in shown.value
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
    assert "speedup on 16 processes: <b>9.1</b>" in shown.value  # 1 / (0.05 + 0.95 / 16)
    assert "limit with any number: <b>20.0</b>" in shown.value


def test_the_scaling_calculator_starts_on_a_step_of_its_slider():
    # Karp-Flatt of 80 h on 1 GPU and 22 h on 4: (22/80 - 1/4) / (1 - 1/4) = 1/30, which a
    # browser's slider would snap to its 0.1% steps (and send back): the calculator starts there
    fraction = widgets.scaling_calculator({1: 80, 4: 22}).children[0]
    assert fraction.value == pytest.approx(0.033, abs=1e-12)


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


def test_the_training_monitor_needs_a_process_or_a_job():
    with pytest.raises(Exception, match="follow a local process or a Slurm job id"):
        widgets.TrainingMonitor("nowhere").follow()
