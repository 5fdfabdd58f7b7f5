"""Memory arithmetic of training: how many bytes a GPU (or CPU process) holds, and what shards it.

    training memory = parameters + gradients + optimiser state + activations (+ temporary buffers)

With AdamW, the optimiser keeps two numbers per parameter (the running mean and variance of the
gradient). Per parameter, in bytes:

    precision   parameters   gradients   optimiser (m, v)   total
    fp32             4            4              8            16
    bf16-mixed       4 + 2        4              8            16 + 2 per gathered copy

bf16-mixed keeps fp32 "master" parameters, computes with bf16 copies, and reduces gradients in
fp32 (the stage scripts' FSDP MixedPrecisionPolicy). Data-parallel strategies differ in what
they split over the N ranks (the ZeRO paper's stages):

    ddp     nothing: every rank holds everything
    zero1   optimiser state                    (DeepSpeed stage 1)
    zero2   optimiser state and gradients      (DeepSpeed stage 2)
    fsdp    optimiser state, gradients and parameters (FSDP, DeepSpeed stage 3); the parameters of
            one block at a time are gathered whole while it runs

Activations are what forward keeps for backward; they grow with micro-batch x sequence length,
not with the world size. Activation checkpointing keeps only each block's input and recomputes
the rest during backward.
"""
from dataclasses import dataclass

from coursekit import KitError

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
PRECISIONS = ("fp32", "bf16-mixed")
DEVICE_GB = (40, 64, 80, 141)  # A100 40 GB, A100 64 GB / MI250X GCD, A100/H100 80 GB, H200
ADAM_STATES = 2  # m and v, fp32


@dataclass(frozen=True)
class Model:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int

    @classmethod
    def from_preset(cls, preset):
        return cls(preset.n_layer, preset.n_embd, preset.n_head, preset.vocab_size, preset.seq_len)

    @property
    def block_parameters(self):
        """One transformer block: qkv and output projections (4 d^2 + 4 d), the MLP (8 d^2 + 5 d)
        and two LayerNorms (4 d)."""
        d = self.n_embd
        return 12 * d * d + 13 * d

    @property
    def parameters(self):
        """Token embeddings (shared with the output head), positions, the blocks, a final norm."""
        d = self.n_embd
        return self.vocab_size * d + self.block_size * d + self.n_layer * self.block_parameters + 2 * d


def activation_bytes(model, micro_batch, seq_len, precision, activation_checkpointing=False):
    """What forward keeps for backward, per rank (Korthikanti et al. 2022, with flash attention,
    which stores no T x T attention matrix): about 34 values per token and width per block in
    16-bit training, twice the bytes in fp32. The logits (fp32 for the loss) come on top. With
    checkpointing, each block keeps its input only, and one block's activations exist at a time
    during recomputation."""
    scale = 1 if precision == "bf16-mixed" else 2  # 34 counts 2-byte values
    tokens_width = micro_batch * seq_len * model.n_embd
    per_block = 34 * tokens_width * scale
    if activation_checkpointing:
        blocks = model.n_layer * 2 * tokens_width * scale + per_block
    else:
        blocks = model.n_layer * per_block
    logits = micro_batch * seq_len * model.vocab_size * 4 * 2  # the logits and their softmax
    return blocks + logits


def per_rank_bytes(model, strategy, world_size, precision="fp32", micro_batch=1, seq_len=None,
                   activation_checkpointing=False):
    """{part: bytes} that one of ``world_size`` ranks holds under ``strategy``, and the total."""
    if strategy not in STRATEGIES:
        raise KitError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise KitError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    n = model.parameters
    level = STRATEGIES.index(strategy)  # 0 ddp ... 3 fsdp: how many parts are sharded
    share = lambda sharded: 1 / world_size if sharded else 1  # noqa: E731
    parts = {
        "params": 4 * n * share(level >= 3),
        "grads": 4 * n * share(level >= 2),
        "optimizer": 4 * ADAM_STATES * n * share(level >= 1),
    }
    if precision == "bf16-mixed":  # bf16 copies to compute with: all of them, or a block's worth
        parts["params"] += 2 * (model.block_parameters if level >= 3 else n)
    parts["activations"] = activation_bytes(model, micro_batch, seq_len or model.block_size,
                                            precision, activation_checkpointing)
    parts["total"] = sum(parts.values())
    return parts


def fits(total_bytes, usable=0.9):
    """{device GB: does it fit?}, leaving a tenth of each device to the CUDA context, the
    allocator's fragmentation and communication buffers."""
    return {gb: total_bytes <= usable * gb * 1e9 for gb in DEVICE_GB}
