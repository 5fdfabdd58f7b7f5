import pytest

from coursekit import KitError, data, presets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset", presets.PRESETS.values(), ids=lambda p: p.name)
def test_batch_arithmetic_is_whole(preset):
    assert preset.n_embd % preset.n_head == 0
    assert preset.batch_tokens % (preset.micro_batch * preset.seq_len) == 0
    assert 0 <= preset.warmup_steps < preset.max_steps


def test_gpt2_124m_is_the_real_recipe():
    p = presets.get_preset("gpt2-124m")
    assert (p.n_layer, p.n_head, p.n_embd, p.seq_len) == (12, 12, 768, 1024)
    # GPT-2's vocabulary (tiktoken's), padded to a multiple of 128 for faster matmuls
    assert p.vocab_size == 50304 and p.vocab_size % 128 == 0
    assert 0 <= p.vocab_size - data.gpt2_encoding().n_vocab < 128
    assert p.batch_tokens == 2**19  # ~0.5M tokens per step
    assert p.max_steps * p.batch_tokens == pytest.approx(10e9, rel=1e-3)  # one pass over sample-10BT


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(KitError, match=r"unknown preset 'huge' \(choose from tiny, small, gpt2-124m\)"):
        presets.get_preset("huge")


def test_default_preset_depends_on_gpu():
    assert presets.default_preset_name(has_gpu=False) == "tiny"
    assert presets.default_preset_name(has_gpu=True) == "gpt2-124m"
