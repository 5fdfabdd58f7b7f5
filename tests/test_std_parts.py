"""Pieces of the std stage script and of the model every stage trains (solutions/gpt.py),
imported and checked in-process."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coursekit import runs, stages, training
from solutions import gpt

pytestmark = pytest.mark.unit
std = stages.load("std")


def test_learning_rate_warms_up_linearly_then_decays_by_cosine():
    lr = [std.learning_rate(s, 1.0, warmup_steps=10, max_steps=110) for s in range(110)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[10] == pytest.approx(1.0) and lr[60] == pytest.approx(0.55)  # halfway: mean of max and min
    assert std.learning_rate(110, 1.0, 10, 110) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))


def make_shards(tmp_path, sizes):
    for i, size in enumerate(sizes):
        np.save(tmp_path / f"train_{i:06d}.npy", np.arange(size, dtype=np.uint16) + 1000 * i)


def test_loader_shifts_targets_walks_shards_and_counts_epochs(tmp_path):
    make_shards(tmp_path, [25, 25])
    loader = std.TokenShardLoader(tmp_path, "train", B=2, T=4)
    x, y = loader.next_batch()
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and torch.equal(y.flatten(), x.flatten() + 1)
    loader.next_batch(), loader.next_batch()  # 0..23 of shard 0; 24 tokens need 25 to shift
    x, _ = loader.next_batch()
    assert x[0, 0] == 1000 and loader.epoch == 0  # on to shard 1
    for _ in range(3):
        x, _ = loader.next_batch()
    assert x[0, 0] == 0 and loader.epoch == 1  # back to shard 0: one epoch done


def test_loader_state_restores_the_same_batches(tmp_path):
    make_shards(tmp_path, [40, 40])
    loader = std.TokenShardLoader(tmp_path, "train", B=1, T=8)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()[0] for _ in range(6)]
    again = std.TokenShardLoader(tmp_path, "train", B=1, T=8)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(expected, [again.next_batch()[0] for _ in range(6)]))


def test_weights_are_tied_and_initialised_like_gpt2():
    torch.manual_seed(0)
    config = std.GPTConfig(vocab_size=1000, block_size=16, n_layer=8, n_head=4, n_embd=256)
    model = std.GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h["0"].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.h["0"].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = std.GPT(std.GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(0, 100, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 100
    before, after = model(idx), model(changed)
    assert torch.equal(before[0, :5], after[0, :5]) and not torch.equal(before[0, 5:], after[0, 5:])


def test_sampling_reads_the_head_at_the_last_position_alone_and_draws_what_the_whole_head_gives():
    torch.manual_seed(0)
    model = std.GPT(std.GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(0, 100, (2, 6))
    last = model(idx, last_position_only=True)
    assert last.shape == (2, 1, 100)
    assert torch.allclose(last[:, 0], model(idx)[:, -1], atol=1e-6)
    whole_head = model.generate(idx, 5, generator=torch.Generator().manual_seed(1),
                                last_logits=lambda context: model(context)[:, -1])
    assert torch.equal(model.generate(idx, 5, generator=torch.Generator().manual_seed(1)),
                       whole_head)


def test_no_weight_decay_on_biases_and_norms():
    model = std.GPT(std.GPTConfig(vocab_size=100, block_size=8, n_layer=1, n_head=2, n_embd=16))
    decay, no_decay = std.configure_optimizer(model, 1e-3, 0.1, torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


class FusedAttention(nn.Module):
    """GPT-2's own attention: q, k and v from one (3C, C) matrix, c_attn."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.scale_init_by_depth = True

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def test_separate_q_k_v_start_as_gpt2s_fused_matrix_and_compute_the_same(monkeypatch):
    """Same seed => the same model as with GPT-2's fused c_attn: on a CPU, normal_ gives a (3C, C)
    matrix bit for bit the numbers it gives three (C, C) matrices in a row; so the first losses
    of every stage are GPT-2's."""
    config = gpt.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    split = gpt.GPT(config)
    monkeypatch.setattr(gpt, "CausalSelfAttention", FusedAttention)
    torch.manual_seed(0)
    fused = gpt.GPT(config)
    split_state, fused_state = split.state_dict(), fused.state_dict()
    for name, tensor in fused_state.items():
        if "c_attn" in name:  # the fused matrix's rows: q's, then k's, then v's
            parts = [split_state[name.replace("c_attn", p)] for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(tensor, torch.cat(parts)), name
        else:
            assert torch.equal(tensor, split_state[name]), name
    idx = torch.randint(0, 256, (2, 16))
    assert torch.allclose(split(idx), fused(idx), atol=1e-6)


def test_a_pipeline_stage_keeps_blocks_by_index_and_passes_the_stream_on():
    """Blocks are keyed by index; without embeddings the model reads the residual stream and
    without its head returns it: three such pieces compute the whole model's logits."""
    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab_size=100, block_size=8, n_layer=3, n_head=2, n_embd=16)
    whole = gpt.GPT(config)
    idx = torch.randint(0, 100, (2, 8))
    pieces = []
    for kept in ("0", "1", "2"):
        torch.manual_seed(0)
        piece = gpt.GPT(config)
        for index in [i for i in piece.transformer.h if i != kept]:
            del piece.transformer.h[index]
        if kept != "0":
            piece.transformer.wte = piece.transformer.wpe = None
        if kept != "2":
            piece.transformer.ln_f = piece.lm_head = None
        pieces.append(piece)
    stream = pieces[0](idx)
    assert stream.shape == (2, 8, 16)
    logits = pieces[2](pieces[1](stream))
    assert torch.equal(logits, whole(idx))
    assert gpt.cross_entropy(logits, idx).item() == pytest.approx(
        F.cross_entropy(whole(idx).view(-1, 100), idx.view(-1)).item())


def fp16_training_parts(data_dir, scale=None):
    """A tiny GPT, its optimiser and loader, and fp16 on the CPU, as the std stage makes them;
    the loss scaler set to ``scale`` (its state_dict) if given."""
    cpu = torch.device("cpu")
    model = std.GPT(std.GPTConfig(vocab_size=512, block_size=8, n_layer=1, n_head=2, n_embd=16))
    optimizer = std.configure_optimizer(model, 1e-3, 0.1, cpu)
    loader = std.TokenShardLoader(data_dir, "train", B=1, T=8)
    precision = training.Precision("fp16", cpu)
    if scale:
        precision.scaler.load_state_dict(scale)
    return model, optimizer, loader, precision, cpu


def test_a_resumed_fp16_run_keeps_its_loss_scale(tmp_path):
    """A scale the run had lowered (after overflows) and 7 steps towards doubling it again: a run
    resumed from the checkpoint goes on from both, instead of 65,536 and 0."""
    make_shards(tmp_path, [100])
    lowered = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
               "growth_interval": 2000, "_growth_tracker": 7}
    run_dir = tmp_path / "run"
    runs.make_run_dir(run_dir)
    std.save_checkpoint(run_dir, 3, *fp16_training_parts(tmp_path, lowered))
    model, optimizer, loader, precision, cpu = fp16_training_parts(tmp_path)
    assert precision.scaler.state_dict() != lowered  # a new scaler starts elsewhere
    assert std.resume(run_dir, model, optimizer, loader, precision, cpu) == 3
    assert precision.scaler.state_dict() == lowered


def test_an_fp16_run_resumed_from_a_bf16_checkpoint_starts_at_the_first_scale(tmp_path):
    make_shards(tmp_path, [100])
    run_dir = tmp_path / "run"
    runs.make_run_dir(run_dir)
    model, optimizer, loader, _, cpu = fp16_training_parts(tmp_path)
    std.save_checkpoint(run_dir, 2, model, optimizer, loader, training.Precision("bf16", cpu), cpu)
    model, optimizer, loader, precision, cpu = fp16_training_parts(tmp_path)
    first_scale = precision.scaler.state_dict()
    assert std.resume(run_dir, model, optimizer, loader, precision, cpu) == 2
    assert precision.scaler.state_dict() == first_scale
