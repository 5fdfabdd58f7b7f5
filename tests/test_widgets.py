"""The lessons' calculators: moving a control changes what the widget shows, and the numbers are
coursekit.memory's."""
import pytest

from coursekit import memory, widgets

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
