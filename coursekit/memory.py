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
            activations of N microbatches in flight, the last those of one, and the logits

Activations are what forward keeps for backward (counted from what autograd saves: see
activation_bytes); they grow with micro-batch x sequence length, not with the world size. The
peak comes as the loss's backward ends, when the gradients of the (micro-batch x sequence x
vocabulary) logits join them (logit_gradient_bytes). Activation checkpointing keeps only each
block's input and recomputes the rest during backward. allocated_peak measures the peak of a CPU
process as a GPU's allocator counts it; benchmarks/memory_per_rank.py sets each stage's beside
per_rank_bytes.
"""
import contextlib
import functools
import itertools
import os
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


#: Bytes a transformer block keeps for backward per token and unit of width d, as autograd saves
#: them (activation_bytes says which; tests/test_memory.py counts them): (what a tensor-parallel
#: rank gathers whole, what it keeps a share of)
BLOCK_BYTES = {"fp32": (8, 56), "16-bit": (8, 32)}
#: Tokens whose logits the loss upcasts to fp32 at a time: solutions/gpt.py's LOSS_CHUNK_TOKENS
LOSS_CHUNK_TOKENS = 1024


def value_bytes(precision):
    """Bytes of one computed value: autocast computes the matmuls in 16 bits."""
    return 4 if precision == "fp32" else 2


def activation_bytes(model, micro_batch, seq_len, precision, activation_checkpointing=False,
                     blocks=None, logits=True, tp=1):
    """Bytes that forward keeps for backward, counted from what autograd saves (flash attention
    keeps no T x T matrix), for ``blocks`` blocks (default: all of them). Per token and unit of
    width, a block keeps in 16-bit training (bf16 or fp16 autocast):

         8  the two LayerNorms' inputs, in fp32: the residual stream stays fp32
         6  the inputs of the q, k and v projections: each casts ln_1's output to 16 bits itself
         6  q, k and v, which attention keeps
         2  attention's output, its projection's input
         2  the MLP's input, ln_2's output cast to 16 bits
        16  the MLP's hidden layer (4 d wide) before and after the GELU
        40  in all; in fp32 64, as nothing is cast (q, k and v share ln_1's output: 4 + 4) and
            every value takes 4 bytes

    and per token 16 bytes of LayerNorm statistics and 4 per head (attention's log-sum-exp).
    With ``tp``-way tensor and sequence parallelism a rank keeps 1/tp of all but the matmuls'
    inputs, which it gathers whole (8 bytes in either precision). After the blocks (``logits``)
    come the final LayerNorm's input (4 bytes), the head's input (2 or 4) and the logits, which
    the loss keeps (2 or 4 bytes each). With checkpointing, each block keeps its input only (4
    bytes, fp32) and one block's activations exist at a time during recomputation."""
    blocks = model.n_layer if blocks is None else blocks
    tokens, d = micro_batch * seq_len, model.n_embd
    gathered, shared = BLOCK_BYTES["fp32" if precision == "fp32" else "16-bit"]
    per_block = tokens * (gathered * d + (shared * d + 16 + 4 * model.n_head) / tp)
    if activation_checkpointing:
        kept = blocks * tokens * 4 * d / tp + per_block
    else:
        kept = blocks * per_block
    if logits:
        head = tokens * (4 * d / tp + value_bytes(precision) * d)
        kept += head + logit_count(model, micro_batch, seq_len) / tp * value_bytes(precision)
    return kept


def logit_count(model, micro_batch, seq_len):
    return micro_batch * seq_len * model.vocab_size


def logit_gradient_bytes(model, micro_batch, seq_len, precision, tp=1,
                         loss_parallel=False):
    """What the loss's backward adds to the activations (solutions/gpt.py's cross_entropy). In
    16 bits it recomputes one chunk of LOSS_CHUNK_TOKENS tokens at a time: the chunk's fp32
    log-probabilities, their gradient and the fp32 gradient of its logits, 12 bytes per logit of
    the chunk; the chunks' gradients in the logits' precision (2 bytes per logit) add up until the
    last chunk. With the logits themselves, that is 4 bytes per logit + 10 per chunk logit. In
    fp32 the loss keeps the log-probabilities instead of the logits and recomputes nothing: a
    chunk's backward adds the gradient of its log-probabilities and of its logits (8 bytes per
    chunk logit), and the chunks' gradients, once all are done, are copied into one (4 + 4 bytes
    per logit, the log-probabilities freed by then), which one chunk needs no copy for. With
    tensor parallelism a rank holds 1/tp of each token's logits, and loss_parallel's
    cross-entropy of vocabulary-split logits keeps one more fp32 value per chunk logit (measured
    in bf16: benchmarks/memory_per_rank.py)."""
    tokens = micro_batch * seq_len
    logits = logit_count(model, micro_batch, seq_len) / tp
    chunk_logits = min(tokens, LOSS_CHUNK_TOKENS) * model.vocab_size / tp
    parallel = 4 * chunk_logits if loss_parallel else 0
    if precision == "fp32":
        return max(4 * logits, 8 * chunk_logits) + parallel
    return 2 * logits + 10 * chunk_logits + parallel


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
    if strategy == "pp":
        return max(pipeline_stage_bytes(model, world_size, precision, micro_batch, seq_len,
                                        activation_checkpointing), key=lambda parts: parts["total"])
    activations = functools.partial(activation_bytes, model, micro_batch, seq_len, precision,
                                    activation_checkpointing)
    if strategy in DATA_PARALLEL:
        parts = data_parallel_bytes(model, DATA_PARALLEL.index(strategy), world_size, precision)
        parts["activations"] = activations()
        parts["logit_grads"] = logit_gradient_bytes(model, micro_batch, seq_len, precision)
    else:  # tp, sequence parallel: the activations are split N ways, the logits by vocabulary
        parts = replicated_bytes(model.tensor_parallel_parameters(world_size), precision)
        parts["activations"] = activations(tp=world_size)
        parts["logit_grads"] = logit_gradient_bytes(model, micro_batch, seq_len, precision,
                                                    tp=world_size, loss_parallel=True)
    parts["total"] = sum(parts.values())
    return parts


def pipeline_stage_bytes(model, stages, precision="fp32", micro_batch=1, seq_len=None,
                         activation_checkpointing=False):
    """[{part: bytes}] of each of ``stages`` pipeline stages at its peak under 1F1B, which keeps
    ``stages - i`` microbatches in flight on stage i: the first stage keeps its blocks'
    activations for the most microbatches, the last for one, but it also keeps the logits and
    their gradients (with GPT-2's vocabulary, the busiest stage)."""
    seq_len = seq_len or model.block_size
    blocks = model.pipeline_stage_blocks(stages)
    every_stage = []
    for i, n in enumerate(model.pipeline_stage_parameters(stages)):
        last = i == stages - 1
        parts = replicated_bytes(n, precision)
        parts["activations"] = (stages - i) * activation_bytes(
            model, micro_batch, seq_len, precision, activation_checkpointing, blocks=blocks[i],
            logits=last)
        parts["logit_grads"] = (logit_gradient_bytes(model, micro_batch, seq_len, precision)
                                if last else 0)
        parts["total"] = sum(parts.values())
        every_stage.append(parts)
    return every_stage


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


@contextlib.contextmanager
def allocated_peak():
    """Measures the most bytes of tensor memory allocated at once while the ``with`` block runs
    (in the dict it yields: "peak", and "unreleased", what was still counted at its end),
    counted from its start: on a CPU, what
    torch.cuda.max_memory_allocated counts on a GPU. The resident set size adds the runtime's
    own memory and keeps freed pages; torch.profiler's memory profile instead records each
    allocation and release of the CPU allocator (FSDP's resized storages and DTensor's internal
    buffers included), which this adds up in order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    result = {}
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no start and stop notes on stderr
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        yield result
    events = sorted((event.start_ns(), event.nbytes())  # the raw events: one per allocation
                    for event in profiler.profiler.kineto_results.events()
                    if event.name() == "[memory]" and event.device_type() == DeviceType.CPU)
    live = list(itertools.accumulate(nbytes for _, nbytes in events)) or [0]
    result["peak"] = max(live)
    # the profiler sees releases on the threads it profiles only: a tensor that a communication
    # thread (gloo's) frees last stays counted, and is still counted when the block ends
    result["unreleased"] = live[-1]


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
