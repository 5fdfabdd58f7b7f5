"""Interactive calculators for the lessons (ipywidgets): they show `coursekit` arithmetic, they do
not compute anything of their own.

    from coursekit import widgets
    widgets.memory_calculator()      # bytes per GPU of a training run, and the devices it fits
"""
import html

import ipywidgets as w

from coursekit import KitError, memory, presets

GPT2 = presets.get_preset("gpt2-124m")
#: Decoder-only shapes to try (GPT-2's sizes from its paper; a 7B and a 70B shape with GPT-2's
#: layout and a 32k vocabulary, for scale: the arithmetic counts GPT-2 blocks, not SwiGLU ones).
MODELS = {
    "tiny (course preset)": memory.Model.from_preset(presets.get_preset("tiny")),
    "GPT-2 124M": memory.Model.from_preset(GPT2),
    "GPT-2 350M": memory.Model(24, 1024, 16, GPT2.vocab_size, 1024),
    "GPT-2 774M": memory.Model(36, 1280, 20, GPT2.vocab_size, 1024),
    "GPT-2 1.5B": memory.Model(48, 1600, 25, GPT2.vocab_size, 1024),
    "7B shape": memory.Model(32, 4096, 32, 32000, 4096),
    "70B shape": memory.Model(80, 8192, 64, 32000, 4096),
}
PARTS = ("params", "grads", "optimizer", "activations", "total")


def memory_table(model_name, strategy, world_size, precision, micro_batch, seq_len,
                 activation_checkpointing):
    """The calculator's output as HTML: GB per part on one rank, and which devices it fits."""
    model = MODELS[model_name]
    parts = memory.per_rank_bytes(model, strategy, world_size, precision, micro_batch, seq_len,
                                  activation_checkpointing)
    rows = "".join(f"<tr><td>{part}</td><td style='text-align:right'>{parts[part] / 1e9:,.2f}"
                   "</td></tr>" for part in PARTS)
    fits = " ".join(f"<span style='color:{'green' if ok else 'crimson'}'>{gb} GB "
                    f"{'fits' if ok else 'too small'}</span>"
                    for gb, ok in memory.fits(parts["total"]).items())
    return (f"<b>{html.escape(model_name)}</b>: {model.parameters / 1e6:,.0f} M parameters, "
            f"{strategy} on {world_size} rank(s), {precision}<br>"
            f"<table><tr><th>per rank</th><th>GB</th></tr>{rows}</table>{fits}")


def memory_calculator():
    """Model, sequence length, micro-batch, world size, strategy and precision in; GB per rank
    and whether that fits on 40 / 64 / 80 / 141 GB devices out. Returns the widget box."""
    controls = {
        "model_name": w.Dropdown(options=list(MODELS), value="GPT-2 124M", description="model"),
        "strategy": w.Dropdown(options=memory.STRATEGIES, value="ddp", description="strategy"),
        "world_size": w.IntSlider(value=4, min=1, max=64, description="ranks"),
        "precision": w.Dropdown(options=memory.PRECISIONS, value="bf16-mixed",
                                description="precision"),
        "micro_batch": w.IntSlider(value=8, min=1, max=64, description="micro-batch"),
        "seq_len": w.Dropdown(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=1024,
                              description="sequence"),
        "activation_checkpointing": w.Checkbox(value=False, description="activation checkpointing"),
    }
    result = w.HTML()

    def update(_=None):
        values = {name: control.value for name, control in controls.items()}
        try:
            result.value = memory_table(**values)
        except KitError as err:  # e.g. more pipeline stages than blocks
            result.value = f"<span style='color:crimson'>{html.escape(str(err))}</span>"

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return w.VBox([*controls.values(), result])
