"""Memory arithmetic against real tensors: the bytes of a real model's parameters, gradients and
AdamW state, what its forward pass saves for backward, and the shares that the tp and pp stage
scripts really hold (the FSDP stage's measured bytes are checked in test_stage_fsdp.py)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
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


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def saved_for_backward(module, forward, precision="fp32"):
    """Bytes autograd keeps for backward while ``forward()`` runs (this rank's shard of a
    DTensor): each storage once, the module's own parameters (saved by its matmuls) and, under
    autocast, their 16-bit copies left out, as they are not activations (memory counts the
    copies with the parameters)."""
    parameters = {local(p).untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
          torch.autocast("cpu", torch.bfloat16, enabled=precision != "fp32")):
        forward()
    copies = sum(2 * local(p).numel() for p in module.parameters() if p.dim() == 2)
    return sum(saved.values()) - (copies if precision != "fp32" else 0)


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


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_blocks_activations_are_what_autograd_saves(precision):
    block = real_model(TINY).transformer.h["0"]
    x = torch.randn(4, TINY.block_size, TINY.n_embd, requires_grad=True)
    measured = saved_for_backward(block, lambda: block(x), precision)
    assert measured == memory.activation_bytes(TINY, 4, TINY.block_size, precision, blocks=1,
                                               logits=False)


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
    assert recomputed < one["activations"] / 2  # the fp32 logits stay: 1.6 of the 2.4 GB


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
    block = model.transformer.h["0"]
    x = torch.randn(2, shape.block_size // 4, shape.n_embd, requires_grad=True)  # its sequence
    for precision in ("fp32", "bf16-mixed"):
        kept = saved_for_backward(block, lambda: block(x), precision)
        assert kept == memory.activation_bytes(shape, 2, shape.block_size, precision, blocks=1,
                                               logits=False, tp=4)


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
    every_stage = memory.pipeline_stage_bytes(GPT2, 5)
    assert [parts["params"] for parts in every_stage] == [4 * n for n in counts]
    assert memory.per_rank_bytes(GPT2, "pp", 5) == max(every_stage, key=lambda p: p["total"])
    with pytest.raises(KitError, match="13 pipeline stages: use 1 to 12"):
        GPT2.pipeline_stage_parameters(13)


def test_the_last_pipeline_stage_holds_the_logits_and_is_the_busiest():
    """Issue 46: the model left the last stage's logits out, and took the first stage, which
    keeps the most microbatches in flight, for the busiest."""
    first, last = memory.pipeline_stage_bytes(GPT2, 2, "bf16-mixed", micro_batch=64)
    assert first["logit_grads"] == 0 and last["logit_grads"] > 0
    assert last["total"] > first["total"]
    assert memory.per_rank_bytes(GPT2, "pp", 2, "bf16-mixed", micro_batch=64) == last


def test_the_loss_chunk_is_the_models():
    assert memory.LOSS_CHUNK_TOKENS == gpt.LOSS_CHUNK_TOKENS


def test_the_chunked_loss_is_pytorchs_cross_entropy():
    logits = torch.randn(3, 50, 40, requires_grad=True)  # 150 tokens: chunks of 64, 64, 22
    targets = torch.randint(0, 40, (3, 50))
    chunked = gpt.cross_entropy(logits, targets, chunk_tokens=64)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)
    whole = F.cross_entropy(logits.view(-1, 40), targets.view(-1))
    (whole_grad,) = torch.autograd.grad(whole, logits)
    torch.testing.assert_close(chunked, whole)  # fp32's tolerances
    torch.testing.assert_close(chunked_grad, whole_grad)


def test_the_loss_never_copies_the_whole_16_bit_logits_to_fp32():
    """bf16 logits of 8 chunks of tokens: what their loss's forward and backward allocate at
    most is the prediction, less than the logits and one fp32 copy of them (which ATen's
    log-softmax of bf16 logits with dtype=float32 makes)."""
    shape = memory.Model(n_layer=1, n_embd=64, n_head=4, vocab_size=1024, block_size=2048)
    scores = torch.randn(4, 2048, shape.vocab_size, dtype=torch.bfloat16)
    bias = torch.zeros(shape.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, shape.vocab_size, (4, 2048))
    with memory.allocated_peak() as measured:
        # the logits: made here (counted, then released by backward), as by the model's head
        gpt.cross_entropy(scores + bias, targets).backward()
    logit_bytes = scores.numel() * 2
    predicted = logit_bytes + memory.logit_gradient_bytes(shape, 4, 2048, "bf16-mixed")
    assert measured["peak"] == pytest.approx(predicted, rel=0.01)
    assert measured["peak"] < logit_bytes + 2 * logit_bytes


@pytest.mark.parametrize("precision, micro_batch, seq_len", [
    ("fp32", 1, 512), ("fp32", 4, 2048), ("bf16-mixed", 1, 512)])  # 1 chunk, 8 chunks, 1 chunk
def test_the_losss_measured_peak_is_the_prediction(precision, micro_batch, seq_len):
    """What the loss's forward and backward allocate at most, in fp32 (which keeps the
    log-probabilities and recomputes nothing: 12 bytes a logit for one chunk, 16 if it were
    recomputed) and for one chunk of 16-bit logits (the test above has 8)."""
    shape = memory.Model(n_layer=1, n_embd=64, n_head=4, vocab_size=1024, block_size=2048)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    scores = torch.randn(micro_batch, seq_len, shape.vocab_size, dtype=dtype)
    bias = torch.zeros(shape.vocab_size, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, shape.vocab_size, (micro_batch, seq_len))
    with memory.allocated_peak() as measured:
        gpt.cross_entropy(scores + bias, targets).backward()
    logit_bytes = scores.numel() * scores.element_size()
    predicted = logit_bytes + memory.logit_gradient_bytes(shape, micro_batch, seq_len, precision)
    assert measured["peak"] == pytest.approx(predicted, rel=0.01)


def test_the_measured_bf16_peak_of_a_tiny_training_step_is_the_prediction():
    """One training step of the tiny model on one process, in bf16, as a GPU's allocator would
    count it: what the step adds to the parameters, gradients and AdamW state (held from a
    first step, as while gradients accumulate) is what coursekit.memory predicts. A sample of 64
    tokens keeps the test short: this CPU computes bf16 matmuls slowly."""
    model = real_model(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's state exists from here on
    x = torch.randint(0, TINY.vocab_size, (1, 64))
    with memory.allocated_peak() as measured:
        with torch.autocast("cpu", torch.bfloat16):
            loss = gpt.cross_entropy(model(x), x)
        loss.backward()
        optimizer.step()
    predicted = memory.per_rank_bytes(TINY, "ddp", 1, "bf16-mixed", micro_batch=1, seq_len=64)
    held = 4 * TINY.parameters * (1 + 1 + memory.ADAM_STATES)  # fp32 parameters, grads, m, v
    assert measured["peak"] == pytest.approx(predicted["total"] - held, rel=0.1)


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero4"}, "strategy 'zero4': use one of ddp, zero1, zero2, fsdp, tp, pp"),
    ({"strategy": "ddp", "precision": "fp8"}, "precision 'fp8': use one of fp32, bf16-mixed, fp16-mixed"),
    ({"strategy": "fsdp", "world_size": 0}, "world size 0: use a whole number of ranks, 1 or more"),
])
def test_bad_choices_name_the_value_and_the_choices(kwargs, message):
    with pytest.raises(KitError) as error:
        memory.per_rank_bytes(TINY, **{"world_size": 2, **kwargs})
    assert str(error.value) == message
