"""Memory arithmetic against real tensors: the bytes of a real model's parameters, gradients and
AdamW state, what its forward pass saves for backward, and the shares that the tp and pp stage
scripts really hold (the FSDP stage's measured bytes are checked in test_stage_fsdp.py)."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from coursekit import KitError, memory, presets, stages
from solutions import gpt

pytestmark = pytest.mark.unit
TINY = memory.Model.from_preset(presets.get_preset("tiny"))
GPT2 = memory.Model.from_preset(presets.get_preset("gpt2-124m"))
#: What each data-parallel strategy splits over the ranks: the ZeRO paper's stages 0 to 3.
SHARDED = {"ddp": set(), "zero1": {"optimizer"}, "zero2": {"optimizer", "grads"},
           "fsdp": {"optimizer", "grads", "params"}}


def real_model(shape, stage="std"):
    """The GPT every stage trains (solutions/gpt.py) with ``shape``'s sizes."""
    return gpt.GPT(gpt.GPTConfig(vocab_size=shape.vocab_size, block_size=shape.block_size,
                                 n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd))


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def measured_tiny():
    """{part: bytes} of the tiny model after one real AdamW step."""
    model = real_model(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, TINY.vocab_size, (1, 16))
    gpt.cross_entropy(model(idx), idx).backward()
    optimizer.step()
    # Adam's per-tensor step counter is one number per tensor, not per parameter: left out
    state = [t for slots in optimizer.state.values() for name, t in slots.items() if name != "step"]
    return {"params": nbytes(model.parameters()),
            "grads": nbytes(p.grad for p in model.parameters()),
            "optimizer": nbytes(state)}


def saved_for_backward(module, forward):
    """Bytes autograd keeps for backward while ``forward()`` runs: each storage once, the
    module's own parameters (saved by its matmuls) left out, as they are not activations."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())


def test_the_parameter_count_is_the_models():
    assert TINY.parameters == sum(p.numel() for p in real_model(TINY).parameters())
    with torch.device("meta"):  # GPT-2 small's shapes, without allocating its 500 MB
        gpt2 = real_model(GPT2)
    assert GPT2.parameters == sum(p.numel() for p in gpt2.parameters())
    assert GPT2.parameters == pytest.approx(124.5e6, rel=0.01)  # GPT-2 small, padded vocabulary


def test_one_rank_holds_the_measured_bytes_of_a_real_training_step(measured_tiny):
    parts = memory.per_rank_bytes(TINY, "ddp", world_size=1)
    assert {part: parts[part] for part in measured_tiny} == measured_tiny


def test_each_zero_stage_splits_its_parts_of_the_measured_bytes(measured_tiny):
    for strategy, sharded in SHARDED.items():
        parts = memory.per_rank_bytes(TINY, strategy, world_size=4)
        for part, whole in measured_tiny.items():
            assert parts[part] == (whole / 4 if part in sharded else whole), (strategy, part)
    totals = [memory.per_rank_bytes(GPT2, s, 4)["total"] for s in memory.DATA_PARALLEL]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_bf16_mixed_adds_the_bytes_of_real_bf16_copies(measured_tiny):
    model = real_model(TINY)
    whole_copy = nbytes(p.detach().to(torch.bfloat16) for p in model.parameters())
    block_copy = nbytes(p.detach().to(torch.bfloat16) for p in model.transformer.h["0"].parameters())
    ddp = memory.per_rank_bytes(TINY, "ddp", 2, precision="bf16-mixed")
    fsdp = memory.per_rank_bytes(TINY, "fsdp", 2, precision="bf16-mixed")
    assert ddp["params"] == measured_tiny["params"] + whole_copy
    assert fsdp["params"] == measured_tiny["params"] / 2 + block_copy  # one block gathered


def test_a_blocks_activations_are_what_autograd_saves():
    block = real_model(TINY).transformer.h["0"]
    x = torch.randn(4, TINY.block_size, TINY.n_embd, requires_grad=True)
    measured = saved_for_backward(block, lambda: block(x))
    formula = memory.activation_bytes(TINY, 4, TINY.block_size, "fp32", blocks=1, logits=False)
    # Korthikanti et al.'s count includes two dropout masks the kit's model does not have
    assert measured == pytest.approx(formula, rel=0.1)


def test_checkpointing_keeps_each_blocks_input_and_recomputes_one_block():
    block = real_model(TINY).transformer.h["0"]
    x = torch.randn(4, TINY.block_size, TINY.n_embd, requires_grad=True)
    kept = saved_for_backward(block, lambda: checkpoint(block, x, use_reentrant=False))
    whole = saved_for_backward(block, lambda: block(x))
    per_blocks = [memory.activation_bytes(TINY, 4, TINY.block_size, "fp32", True, blocks=n,
                                          logits=False) for n in (1, 2)]
    assert per_blocks[1] - per_blocks[0] == kept == x.numel() * x.element_size()
    assert per_blocks[0] - kept == pytest.approx(whole, rel=0.1)


def test_activations_do_not_shrink_with_more_data_parallel_ranks():
    one = memory.per_rank_bytes(GPT2, "fsdp", 1, micro_batch=8)
    eight = memory.per_rank_bytes(GPT2, "fsdp", 8, micro_batch=8)
    assert one["activations"] == eight["activations"]  # each rank runs its own micro-batch
    recomputed = memory.activation_bytes(GPT2, 8, 1024, "fp32", activation_checkpointing=True)
    assert recomputed < one["activations"] / 2  # the fp32 logits stay: 3.3 of the 4.0 GB


def test_fits_leaves_a_tenth_of_each_device():
    assert memory.fits(50e9) == {40: False, 64: True, 80: True, 141: True}
    assert memory.fits(37e9)[40] is False and memory.fits(35e9)[40] is True


@pytest.fixture
def fake_process_group():
    """A 4-rank process group that only this process joins ("fake" backend: collectives do
    nothing), enough for the tp stage's plan to shard a model as rank 0 would."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_share_is_what_the_tp_stage_holds(fake_process_group):
    shape = memory.Model(n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=64)
    model = real_model(shape)
    stages.load("tp").apply_tp(model, fake_process_group)
    held = sum(p.to_local().numel() for p in model.parameters())
    assert shape.tensor_parallel_parameters(4) == held
    assert shape.tensor_parallel_parameters(1) == shape.parameters
    tp = memory.per_rank_bytes(GPT2, "tp", 4, micro_batch=8)
    ddp = memory.per_rank_bytes(GPT2, "ddp", 4, micro_batch=8)
    assert tp["activations"] == ddp["activations"] / 4  # sequence parallel splits them too


def test_pipeline_stages_hold_what_the_pp_stage_keeps():
    pp = stages.load("pp")
    counts = []
    for stage in range(5):  # 12 blocks over 5 stages
        with torch.device("meta"):
            kept = pp.keep_stage(real_model(GPT2), stage, 5)
        counts.append(sum(p.numel() for p in kept.parameters()))
    assert GPT2.pipeline_stage_blocks(5) == [3, 3, 2, 2, 2]
    assert GPT2.pipeline_stage_parameters(5) == counts
    assert GPT2.pipeline_stage_parameters(1) == [GPT2.parameters]
    assert memory.per_rank_bytes(GPT2, "pp", 5)["params"] == 4 * max(counts)
    with pytest.raises(KitError, match="13 pipeline stages: use 1 to 12"):
        GPT2.pipeline_stage_parameters(13)


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero4"}, "strategy 'zero4': use one of ddp, zero1, zero2, fsdp, tp, pp"),
    ({"strategy": "ddp", "precision": "fp8"}, "precision 'fp8': use one of fp32, bf16-mixed, fp16-mixed"),
    ({"strategy": "fsdp", "world_size": 0}, "world size 0: use a whole number of ranks, 1 or more"),
])
def test_bad_choices_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(KitError) as error:
        memory.per_rank_bytes(TINY, **{"world_size": 2, **kwargs})
    assert str(error.value) == message
