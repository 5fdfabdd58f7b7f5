"""Memory arithmetic of training: how many bytes a GPU (or CPU process) holds, and what shards it.

    training memory = parameters + gradients + optimiser state + activations (+ temporary buffers)

With AdamW, the optimiser keeps two numbers per parameter (the running mean and variance of the
gradient). Per parameter, in bytes:

    precision   parameters   gradients   optimiser (m, v)   total
    fp32             4            4              8            16
    bf16-mixed       4 + 2        4              8            16 + 2 per gathered copy

bf16-mixed keeps fp32 "master" parameters, computes with bf16 copies, and reduces gradients in
fp32 (the stage scripts' FSDP MixedPrecisionPolicy); fp16-mixed (GPUs without bf16) holds the
same bytes. Data-parallel strategies differ in what
they split over the N ranks (the ZeRO paper's stages):

    ddp     nothing: every rank holds everything
    zero1   optimiser state                    (DeepSpeed stage 1)
    zero2   optimiser state and gradients      (DeepSpeed stage 2)
    fsdp    optimiser state, gradients and parameters (FSDP, DeepSpeed stage 3); the parameters of
            one block at a time are gathered whole while it runs

Model-parallel strategies split the model itself, so activations shrink too:

    tp      tensor parallelism (Megatron-style, with sequence parallelism): every matrix and both
            embeddings are split N ways; LayerNorms and the biases added after a row-wise split
            are replicated; activations are split N ways along the sequence or the width
    pp      pipeline parallelism: N stages of consecutive blocks; the first stage also holds the
            embeddings, the last the final norm and its own copy of the tied output matrix. The
            busiest stage decides whether the model fits; with 1F1B the first stage keeps the
            activations of N microbatches in flight

Activations are what forward keeps for backward; they grow with micro-batch x sequence length,
not with the world size. The peak comes as backward starts, when the gradients of the loss's
(micro-batch x sequence x vocabulary) log-probabilities and logits join them. Activation checkpointing keeps only each block's input and recomputes
the rest during backward.
"""
import functools
from pathlib import Path
from dataclasses import dataclass

from coursekit import KitError

DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp")  # each shards one more part than the last
STRATEGIES = DATA_PARALLEL + ("tp", "pp")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
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
    def embedding_parameters(self):
        """Token embeddings (shared with the output head) and positions."""
        return (self.vocab_size + self.block_size) * self.n_embd

    @property
    def parameters(self):
        """Token embeddings (shared with the output head), positions, the blocks, a final norm."""
        return self.embedding_parameters + self.n_layer * self.block_parameters + 2 * self.n_embd

    def tensor_parallel_parameters(self, tp):
        """Parameters one of ``tp`` ranks holds: the matrices, the biases of column-wise layers
        (q, k, v and the MLP's first layer: 7 d per block) and the embeddings are split; the
        LayerNorms (4 d per block, 2 d at the end) and the row-wise layers' biases (2 d) are not."""
        d = self.n_embd
        split = self.embedding_parameters + self.n_layer * (12 * d * d + 7 * d)
        return split / tp + self.n_layer * 6 * d + 2 * d

    def pipeline_stage_blocks(self, stages):
        """Blocks of each of ``stages`` pipeline stages: as even as possible, earlier stages
        taking one more (the last also runs the output head)."""
        if not 1 <= stages <= self.n_layer:
            raise KitError(f"{stages} pipeline stages: use 1 to {self.n_layer}, one block or "
                           "more per stage")
        return [self.n_layer // stages + (i < self.n_layer % stages) for i in range(stages)]

    def pipeline_stage_parameters(self, stages):
        """Parameters of each of ``stages`` pipeline stages: their blocks; the first stage adds
        the embeddings, the last the final norm and, when it is not also the first, a copy of the
        tied output matrix."""
        counts = [n * self.block_parameters for n in self.pipeline_stage_blocks(stages)]
        counts[0] += self.embedding_parameters
        counts[-1] += 2 * self.n_embd + (self.vocab_size * self.n_embd if stages > 1 else 0)
        return counts


def activation_bytes(model, micro_batch, seq_len, precision, activation_checkpointing=False,
                     blocks=None, logits=True):
    """Bytes that forward keeps for backward (Korthikanti et al. 2022, with flash attention, which
    stores no T x T attention matrix): about 34 bytes per token and width per block in 16-bit
    training (their 34sbh counts bytes: 2 per 16-bit value, 1 per dropout-mask entry), twice that
    in fp32, for ``blocks`` blocks (default: all of them). The loss's fp32 log-probabilities
    (4 bytes per logit, in any precision) come on top. With checkpointing, each block keeps its
    input only, and one block's activations exist at a time during recomputation."""
    blocks = model.n_layer if blocks is None else blocks
    scale = 2 if precision == "fp32" else 1  # 34 bytes holds 2-byte values
    tokens_width = micro_batch * seq_len * model.n_embd
    per_block = 34 * tokens_width * scale
    if activation_checkpointing:
        kept = blocks * 2 * tokens_width * scale + per_block
    else:
        kept = blocks * per_block
    return kept + (logit_count(model, micro_batch, seq_len) * 4 if logits else 0)


def logit_count(model, micro_batch, seq_len):
    return micro_batch * seq_len * model.vocab_size


def logit_gradient_bytes(model, micro_batch, seq_len, precision):
    """What the start of backward adds to the activations: the gradients of the log-probabilities
    (fp32) and of the logits (in the logits' precision), 6 or 8 bytes per logit. With GPT-2's
    vocabulary they outweigh a micro-batch's activations."""
    return logit_count(model, micro_batch, seq_len) * (4 + (4 if precision == "fp32" else 2))


def per_rank_bytes(model, strategy, world_size, precision="fp32", micro_batch=1, seq_len=None,
                   activation_checkpointing=False):
    """{part: bytes} that one of ``world_size`` ranks holds under ``strategy`` (for pp, the
    busiest stage) at its peak, the start of backward, and the total."""
    if strategy not in STRATEGIES:
        raise KitError(f"strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise KitError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise KitError(f"world size {world_size!r}: use a whole number of ranks, 1 or more")
    seq_len = seq_len or model.block_size
    activations = functools.partial(activation_bytes, model, micro_batch, seq_len, precision,
                                    activation_checkpointing)
    logit_gradients = logit_gradient_bytes(model, micro_batch, seq_len, precision)
    if strategy in DATA_PARALLEL:
        parts = data_parallel_bytes(model, DATA_PARALLEL.index(strategy), world_size, precision)
        parts["activations"] = activations()
    elif strategy == "tp":  # sequence parallel: every activation is split N ways too
        parts = replicated_bytes(model.tensor_parallel_parameters(world_size), precision)
        parts["activations"] = activations() / world_size
        logit_gradients /= world_size  # the logits are split over the vocabulary
    else:
        stages = model.pipeline_stage_parameters(world_size)
        parts = replicated_bytes(max(stages), precision)
        # 1F1B: the first stage holds its blocks' activations for `world_size` microbatches
        first_blocks = model.pipeline_stage_blocks(world_size)[0]
        parts["activations"] = world_size * activations(blocks=first_blocks,
                                                        logits=world_size == 1)
        logit_gradients *= world_size == 1  # the busiest stage is the first, without the head
    parts["logit_grads"] = logit_gradients
    parts["total"] = sum(parts.values())
    return parts


def data_parallel_bytes(model, level, world_size, precision):
    """ZeRO level 0 (ddp) to 3 (fsdp): how many of optimiser state, gradients and parameters are
    split over the ranks."""
    n = model.parameters
    share = lambda sharded: 1 / world_size if sharded else 1  # noqa: E731
    parts = {
        "params": 4 * n * share(level >= 3),
        "grads": 4 * n * share(level >= 2),
        "optimizer": 4 * ADAM_STATES * n * share(level >= 1),
    }
    if precision != "fp32":  # 16-bit copies to compute with: all of them, or a block's worth
        parts["params"] += 2 * (model.block_parameters if level >= 3 else n)
    return parts


def replicated_bytes(n, precision):
    """A rank that holds ``n`` parameters whole, with their gradients and Adam state."""
    parts = {"params": 4 * n, "grads": 4 * n, "optimizer": 4 * ADAM_STATES * n}
    if precision != "fp32":
        parts["params"] += 2 * n
    return parts


def fits(total_bytes):
    """{device GB: does it fit?} for the usual device sizes (fits_in)."""
    return {gb: fits_in(total_bytes, gb) for gb in DEVICE_GB}


def micro_batch_fits(preset, strategy, ranks, precision, micro_batch, device_gb):
    """Does one of ``ranks`` ranks training ``preset`` under ``strategy`` at ``micro_batch`` fit a
    device of ``device_gb`` GB, by its peak (per_rank_bytes) and fits_in's margin?"""
    peak = per_rank_bytes(Model.from_preset(preset), strategy, ranks, precision, micro_batch,
                          preset.seq_len)["total"]
    return fits_in(peak, device_gb)


def fits_in(total_bytes, device_gb, usable=0.9):
    """Does it fit a device of ``device_gb`` GB, leaving a tenth of it to the CUDA context, the
    allocator's fragmentation and communication buffers?"""
    return total_bytes <= usable * device_gb * 1e9


# --- what a training process holds, measured ---------------------------------------------------

MEASURED_PARTS = ("params", "grads", "optimizer", "peak")  # bytes


def local_bytes(tensors):
    """Bytes of these tensors on this rank: a sharded (DTensor) one counts its local shard."""
    from torch.distributed.tensor import DTensor
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


def measured(model, optimizer, device):
    """Bytes this rank holds in its parameters, gradients and optimiser state (its shards of
    them, when sharded), and its peak memory: the CUDA allocator's on a GPU, the resident set
    size on a CPU."""
    import resource

    import torch

    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    if device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "CUDA allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "RSS"
    return {"params": local_bytes(params),
            "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": local_bytes(state), "peak": peak, "peak_kind": peak_kind}


def report(run_dir, model, optimizer, device):
    """Every rank's measured memory, printed by rank 0 and written to RUN_DIR/memory.json."""
    import torch.distributed as dist

    from coursekit import launch, runs

    mine = measured(model, optimizer, device)
    numbers = [mine[part] for part in MEASURED_PARTS]
    every_rank = (launch.numbers_of_every_rank(numbers, device) if dist.is_initialized()
                  else [numbers])  # the std stage: one process, no group
    reports = [{**dict(zip(MEASURED_PARTS, numbers)), "peak_kind": mine["peak_kind"]}
               for numbers in every_rank]  # every rank has the same kind of device
    for rank, r in enumerate(reports):
        print(f"rank {rank} | params {r['params'] / 2**20:.2f} MiB | grads "
              f"{r['grads'] / 2**20:.2f} MiB | optimizer {r['optimizer'] / 2**20:.2f} MiB | "
              f"peak {r['peak'] / 2**20:.1f} MiB ({r['peak_kind']})")
    if not dist.is_initialized() or dist.get_rank() == 0:
        runs.write_json_atomic(Path(run_dir) / "memory.json", reports)
