"""Memory arithmetic: the parameter count of the real model, what each strategy shards, and the
effect of activation checkpointing (the FSDP stage's measured bytes are checked against it in
test_stage_fsdp.py)."""
import pytest

from coursekit import KitError, memory, presets, stages

pytestmark = pytest.mark.unit
TINY = memory.Model.from_preset(presets.get_preset("tiny"))
GPT2 = memory.Model.from_preset(presets.get_preset("gpt2-124m"))


def test_the_parameter_count_is_the_models():
    std = stages.load("std")
    tiny = presets.get_preset("tiny")
    model = std.GPT(std.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                                  n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd))
    assert TINY.parameters == sum(p.numel() for p in model.parameters())
    assert GPT2.parameters == pytest.approx(124.5e6, rel=0.01)  # GPT-2 small, padded vocabulary


def test_each_zero_stage_shards_one_more_part():
    parts = {s: memory.per_rank_bytes(GPT2, s, world_size=4) for s in memory.DATA_PARALLEL}
    n = GPT2.parameters
    assert parts["ddp"]["params"] + parts["ddp"]["grads"] + parts["ddp"]["optimizer"] == 16 * n
    assert parts["zero1"]["optimizer"] == 8 * n / 4 and parts["zero1"]["grads"] == 4 * n
    assert parts["zero2"]["grads"] == 4 * n / 4 and parts["zero2"]["params"] == 4 * n
    assert parts["fsdp"]["params"] == 4 * n / 4
    totals = [parts[s]["total"] for s in memory.DATA_PARALLEL]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_activations_do_not_shrink_with_more_ranks_but_with_checkpointing():
    one = memory.per_rank_bytes(GPT2, "fsdp", 1, micro_batch=8)
    eight = memory.per_rank_bytes(GPT2, "fsdp", 8, micro_batch=8)
    assert one["activations"] == eight["activations"] and eight["params"] == one["params"] / 8
    recomputed = memory.activation_bytes(GPT2, 8, 1024, "fp32", activation_checkpointing=True)
    assert recomputed < one["activations"] / 2  # the fp32 logits stay: 3.3 of the 4.0 GB
    assert memory.activation_bytes(GPT2, 16, 1024, "fp32") == \
           2 * memory.activation_bytes(GPT2, 8, 1024, "fp32")


def test_bf16_mixed_adds_compute_copies():
    ddp = memory.per_rank_bytes(GPT2, "ddp", 2, precision="bf16-mixed")
    fsdp = memory.per_rank_bytes(GPT2, "fsdp", 2, precision="bf16-mixed")
    assert ddp["params"] == 6 * GPT2.parameters
    assert fsdp["params"] == 4 * GPT2.parameters / 2 + 2 * GPT2.block_parameters


def test_fits_leaves_a_tenth_of_each_device():
    assert memory.fits(50e9) == {40: False, 64: True, 80: True, 141: True}
    assert memory.fits(37e9)[40] is False and memory.fits(35e9)[40] is True


def test_tensor_parallel_splits_the_matrices_and_the_activations():
    whole, four = GPT2.tensor_parallel_parameters(1), GPT2.tensor_parallel_parameters(4)
    assert whole == GPT2.parameters
    replicated = GPT2.n_layer * 6 * GPT2.n_embd + 2 * GPT2.n_embd  # LayerNorms, row-wise biases
    assert four == pytest.approx((GPT2.parameters - replicated) / 4 + replicated)
    tp = memory.per_rank_bytes(GPT2, "tp", 4, micro_batch=8)
    ddp = memory.per_rank_bytes(GPT2, "ddp", 4, micro_batch=8)
    assert tp["activations"] == ddp["activations"] / 4 and tp["params"] == 4 * four


def test_pipeline_stages_share_the_blocks_and_copy_the_tied_matrix():
    stages = GPT2.pipeline_stage_parameters(5)  # 12 blocks: 3, 3, 2, 2, 2
    blocks = [3, 3, 2, 2, 2]
    assert [round((n - GPT2.embedding_parameters * (i == 0)) / GPT2.block_parameters)
            for i, n in enumerate(stages[:-1])] == blocks[:-1]
    copy = GPT2.vocab_size * GPT2.n_embd
    assert sum(stages) == GPT2.parameters + copy
    assert GPT2.pipeline_stage_parameters(1) == [GPT2.parameters]
    pp = memory.per_rank_bytes(GPT2, "pp", 5)
    assert pp["params"] == 4 * max(stages)
    with pytest.raises(KitError, match="13 pipeline stages: use 1 to 12"):
        GPT2.pipeline_stage_parameters(13)


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero4"}, "strategy 'zero4': use one of ddp, zero1, zero2, fsdp, tp, pp"),
    ({"strategy": "ddp", "precision": "fp8"}, "precision 'fp8': use one of fp32, bf16-mixed"),
    ({"strategy": "fsdp", "world_size": 0}, "world size 0: use a whole number of ranks, 1 or more"),
])
def test_bad_choices_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(KitError) as error:
        memory.per_rank_bytes(TINY, **{"world_size": 2, **kwargs})
    assert str(error.value) == message
