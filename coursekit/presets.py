"""Model and batch sizes of the stage scripts, one preset per scale.

``tiny`` trains visibly on a 2-core laptop CPU in a minute or two. ``small`` is a step up for a
single GPU or a patient CPU (about 4.5 epochs of the builtin corpus). ``gpt2-124m`` is the real
GPT-2 small recipe: 12 layers, 768 wide, 1024 context, ~0.5M tokens per optimiser step, 10B tokens
of FineWeb-Edu in 19,073 steps.
"""
from dataclasses import asdict, dataclass

from coursekit import KitError

GPT2_VOCAB = 50257
#: GPT-2's vocabulary padded up to a multiple of 128: faster matmuls on GPUs, 47 unused logits.
PADDED_VOCAB = 50304


@dataclass(frozen=True)
class Preset:
    name: str
    # model shape
    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int  # T: tokens per sample, also the model's context length
    vocab_size: int
    # batch: micro_batch samples per forward/backward, batch_tokens per optimiser step
    micro_batch: int
    batch_tokens: int
    # optimisation
    max_steps: int
    warmup_steps: int
    lr: float
    weight_decay: float
    grad_clip: float
    # bookkeeping
    eval_interval: int
    eval_steps: int
    ckpt_interval: int
    data: str  # default prepared-data directory, relative to the working directory

    def as_dict(self):
        return asdict(self)


PRESETS = {
    p.name: p
    for p in (
        Preset("tiny", n_layer=4, n_head=4, n_embd=64, seq_len=128, vocab_size=PADDED_VOCAB,
               micro_batch=4, batch_tokens=1024, max_steps=300, warmup_steps=20, lr=3e-3,
               weight_decay=0.1, grad_clip=1.0, eval_interval=50, eval_steps=8,
               ckpt_interval=100, data="data/builtin"),
        Preset("small", n_layer=6, n_head=6, n_embd=384, seq_len=256, vocab_size=PADDED_VOCAB,
               micro_batch=16, batch_tokens=8192, max_steps=400, warmup_steps=40, lr=1.5e-3,
               weight_decay=0.1, grad_clip=1.0, eval_interval=50, eval_steps=10,
               ckpt_interval=100, data="data/builtin"),
        Preset("gpt2-124m", n_layer=12, n_head=12, n_embd=768, seq_len=1024,
               vocab_size=PADDED_VOCAB, micro_batch=64, batch_tokens=524288, max_steps=19073,
               warmup_steps=715, lr=6e-4, weight_decay=0.1, grad_clip=1.0, eval_interval=250,
               eval_steps=20, ckpt_interval=1000, data="data/fineweb-edu"),
    )
}


def get_preset(name):
    """The preset called ``name``; a KitError naming the allowed ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KitError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None


def default_preset_name(has_gpu):
    """The real model on a GPU, the tiny one on a CPU (DESIGN.md: tiny without a GPU)."""
    return "gpt2-124m" if has_gpu else "tiny"
