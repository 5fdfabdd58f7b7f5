"""GPT-2, written once: the model every stage of the course trains.

A decoder-only transformer: pre-LayerNorm blocks, learned positions, tied embeddings, with GPT-2's
parameter names and initialisation. It knows nothing of parallelism. Each stage applies its kind to
it from outside (lesson 02 wraps it in DDP, lesson 04 shards, splits and slices it), which is why it
is written in a form all of them can use unchanged:

- q, k and v are three projections rather than GPT-2's one fused ``c_attn``: tensor parallelism
  hands each rank whole heads of each. They start bit-identical to the fused matrix (on a CPU).
- the blocks are keyed by their index (``transformer.h["3"]``): a pipeline stage deletes the ones
  it does not hold, and those it keeps keep their names.
- embeddings and head may be deleted (set to None) too: a middle pipeline stage reads and returns
  the residual stream.
- the loss is computed outside the model, ``cross_entropy(model(x), y)``: a pipeline's last stage
  hands it its logits, and tensor parallelism computes it on logits split over the vocabulary.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from coursekit import presets


@dataclass
class GPTConfig:
    vocab_size: int = presets.PADDED_VOCAB
    block_size: int = 1024  # longest sequence the position table covers
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        # GPT-2 computes q, k and v in one (3C, C) matmul; three (C, C) ones, drawn in the same
        # order, hold the same numbers and let a tensor-parallel rank take whole heads of each
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.scale_init_by_depth = True

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim); "-1" heads: a tensor-parallel shard works unchanged
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        # flash attention where the hardware has it; never materialises the T x T matrix
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.scale_init_by_depth = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # residual stream: blocks add to it, never replace it
        return x + self.mlp(self.ln_2(x))


#: Tokens whose logits the loss turns into fp32 at a time: 1,024 x 50,304 vocabulary x 4 bytes is
#: 0.2 GB per chunk, where the whole micro-batch's fp32 logits are 13 GB for GPT-2 at B = 64.
LOSS_CHUNK_TOKENS = 1024


def cross_entropy(logits, targets, chunk_tokens=LOSS_CHUNK_TOKENS):
    """Mean loss per token, computed in fp32 whatever precision the logits are in, a chunk of
    tokens at a time. An fp32 log-softmax of 16-bit logits copies them to fp32 first (ATen fuses
    the cast for fp16 on GPUs only), and autograd would keep the fp32 log-probabilities: 4 bytes a
    logit for the whole micro-batch, the largest tensor of the step. Checkpointing each 16-bit
    chunk keeps only the logits themselves; backward recomputes the chunk's fp32 values one at a
    time. fp32 logits gain nothing from it (the log-probabilities autograd keeps take their place,
    4 bytes for 4), so they are not recomputed: a sixth of a tiny model's step on a CPU."""
    logits, targets = logits.flatten(0, -2), targets.flatten()
    loss = summed_cross_entropy if logits.dtype == torch.float32 else checkpointed_cross_entropy
    if targets.numel() <= chunk_tokens:  # one chunk: no split, whose backward copies the gradient
        return loss(logits, targets) / targets.numel()
    chunks = zip(logits.split(chunk_tokens), targets.split(chunk_tokens))
    return sum(loss(chunk, chunk_targets) for chunk, chunk_targets in chunks) / targets.numel()


def summed_cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def checkpointed_cross_entropy(logits, targets):
    return checkpoint(summed_cross_entropy, logits, targets, use_reentrant=False)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)}),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one matrix in and out
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2's initialisation; projections into the residual stream are scaled by
        # 1/sqrt(2 n_layer) so the stream's variance does not grow with depth
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "scale_init_by_depth", False):
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, x, last_position_only=False):
        """Token ids (B, T) in, logits (B, T, vocab) out, or (B, 1, vocab) with
        ``last_position_only``: sampling needs no more, and the head's vocabulary-wide matmul at
        every position was most of a sample's time. Without its embeddings the model reads the
        residual stream (B, T, C) instead; without its head it returns it."""
        if self.transformer.wte is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.transformer.wte(x) + self.transformer.wpe(pos)
        for block in self.transformer.h.values():
            x = block(x)
        if self.lm_head is None:
            return x
        if last_position_only:
            x = x[:, -1:, :]
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=50, generator=None,
                 last_logits=None):
        """Continue ``idx`` by sampling from the top_k most likely tokens, one token at a time.
        ``last_logits(context)`` gives the logits of the context's last position: the model's
        forward, unless a stage that spreads the model over processes says how to get them."""
        last_logits = last_logits or (lambda context: self(context, last_position_only=True)[:, -1])
        for _ in range(max_new_tokens):
            logits = last_logits(idx[:, -self.config.block_size:]) / temperature
            top_values, _ = torch.topk(logits, top_k)
            logits[logits < top_values[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
