"""Interactive calculators for the lessons (ipywidgets): they show `coursekit` arithmetic, they do
not compute anything of their own.

    from coursekit import widgets
    widgets.batch_calculator()        # tokens per step and steps per epoch
    widgets.scaling_calculator(times) # speedup, efficiency and Amdahl's curve of measured runs
    widgets.memory_calculator()       # bytes per GPU of a training run, and the devices it fits
    widgets.batchfile_builder()       # the batch file the generator writes for a site and shape
    widgets.TrainingMonitor(run_dir).follow(process)   # loss and tokens/s of a running job

Figures are PNG images inside an HTML widget, so that a page of the book shows them with no
kernel and no plotting library in the browser.
"""
import base64
import html
import io
import subprocess
import time
from pathlib import Path

import ipywidgets as w
from matplotlib.figure import Figure

from coursekit import KitError, memory, presets, runs, scaling, slurm

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
PARTS = ("params", "grads", "optimizer", "activations", "logit_grads", "total")


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


def calculator(controls, render):
    """A box of ``controls`` ({argument name: widget}) above an HTML result that shows
    ``render(**values)`` and is redrawn whenever a control moves; a KitError is shown as text."""
    result = w.HTML()

    def update(_=None):
        values = {name: control.value for name, control in controls.items()}
        try:
            result.value = render(**values)
        except KitError as err:  # e.g. more pipeline stages than blocks
            result.value = f"<span style='color:crimson'>{html.escape(str(err))}</span>"

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return w.VBox([*controls.values(), result])


def figure_html(fig):
    """A matplotlib figure as an inline PNG <img>."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return f"<img src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'>"


def memory_calculator():
    """Model, sequence length, micro-batch, world size, strategy and precision in; GB per rank
    and whether that fits on 40 / 64 / 80 / 141 GB devices out. Returns the widget box."""
    return calculator({
        "model_name": w.Dropdown(options=list(MODELS), value="GPT-2 124M", description="model"),
        "strategy": w.Dropdown(options=memory.STRATEGIES, value="ddp", description="strategy"),
        "world_size": w.IntSlider(value=4, min=1, max=64, description="ranks"),
        "precision": w.Dropdown(options=memory.PRECISIONS, value="bf16-mixed",
                                description="precision"),
        "micro_batch": w.IntSlider(value=8, min=1, max=64, description="micro-batch"),
        "seq_len": w.Dropdown(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=1024,
                              description="sequence"),
        "activation_checkpointing": w.Checkbox(value=False, description="activation checkpointing"),
    }, memory_table)


# --- batch ---------------------------------------------------------------------------------------

SEQ_LENS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
FINEWEB_EDU_TOKENS = 10_000_000_000  # sample-10BT, GPT-2 tokens


def batch_table(micro_batch, grad_accum, processes, seq_len, dataset_tokens):
    tokens = scaling.tokens_per_step(micro_batch, grad_accum, seq_len, processes)
    steps = scaling.steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len, processes)
    return (f"<b>{tokens:,} tokens per step</b>: {micro_batch} samples x {grad_accum} "
            f"accumulation step(s) x {processes} process(es) = "
            f"{micro_batch * grad_accum * processes:,} samples of {seq_len:,} tokens<br>"
            f"<b>{steps:,} steps per epoch</b> of {dataset_tokens:,} tokens")


def batch_calculator(preset="gpt2-124m", dataset_tokens=FINEWEB_EDU_TOKENS):
    """Micro-batch, gradient accumulation, processes and sequence length in; tokens per step and
    steps per epoch of ``dataset_tokens`` out. Starts at the preset's batch on one process."""
    shape = presets.get_preset(preset)
    return calculator({
        "micro_batch": w.IntSlider(value=shape.micro_batch, min=1, max=128, description="micro-batch"),
        "grad_accum": w.IntSlider(value=shape.batch_tokens // (shape.micro_batch * shape.seq_len),
                                  min=1, max=64, description="grad_accum"),
        "processes": w.IntSlider(value=1, min=1, max=512, description="processes"),
        "seq_len": w.Dropdown(options=SEQ_LENS, value=shape.seq_len, description="sequence"),
        "dataset_tokens": w.IntText(value=dataset_tokens, description="data tokens"),
    }, batch_table)


# --- scaling -------------------------------------------------------------------------------------

def scaling_table(times, serial_fraction, max_processes):
    """Measured rows (if any), Amdahl's limit for the serial fraction, and the curve."""
    processes = sorted({1, *range(2, max_processes + 1, max(1, max_processes // 64)), max_processes})
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    ax.plot(processes, processes, ":", color="grey", label="ideal")
    ax.plot(processes, [scaling.amdahl_speedup(serial_fraction, p) for p in processes],
            label=f"Amdahl, serial fraction {serial_fraction:.1%}")
    text = ""
    if times:
        rows = scaling.measured_scaling(times)
        ax.plot([r[0] for r in rows], [r[2] for r in rows], "ko", label="measured")
        text = ("<table><tr><th>processes</th><th>seconds</th><th>speedup</th><th>efficiency</th>"
                "<th>serial fraction</th></tr>" + "".join(
                    f"<tr><td>{p}</td><td>{t:,.3g}</td><td>{s:.2f}</td><td>{e:.0%}</td>"
                    f"<td>{'' if kf is None else f'{kf:.1%}'}</td></tr>" for p, t, s, e, kf in rows)
                + "</table>")
    ax.set_xlabel("processes")
    ax.set_ylabel("speedup")
    ax.legend()
    limit = "none" if serial_fraction == 0 else f"{1 / serial_fraction:,.1f}"
    at_most = scaling.amdahl_speedup(serial_fraction, max_processes)
    return (f"{text}speedup on {max_processes} processes: <b>{at_most:.1f}</b> "
            f"(efficiency {at_most / max_processes:.0%}); limit with any number: <b>{limit}</b><br>"
            f"{figure_html(fig)}")


SERIAL_FRACTION_STEP = 0.001  # 0.1%


def scaling_calculator(times=None, max_processes=64):
    """Speedup, efficiency and Amdahl's curve. ``times`` = {processes: seconds for the same job},
    measured; the serial-fraction slider starts at the Karp-Flatt fit of the measured runs."""
    measured = [r[4] for r in scaling.measured_scaling(times)[1:]] if times else []
    start = min(max(sum(measured) / len(measured), 0.0), 0.5) if measured else 0.05
    # on the slider's steps: a browser's slider snaps any other value to one and sends it back
    start = round(start / SERIAL_FRACTION_STEP) * SERIAL_FRACTION_STEP
    controls = {
        "serial_fraction": w.FloatSlider(value=start, min=0.0, max=0.5, step=SERIAL_FRACTION_STEP,
                                         readout_format=".1%", description="serial fraction"),
        "max_processes": w.IntSlider(value=max_processes, min=2, max=1024, description="processes"),
    }
    return calculator(controls, lambda **values: scaling_table(times, **values))


# --- batch files ---------------------------------------------------------------------------------

def batchfile_text(site, stage, nodes, gpus):
    """The batch file the generator writes for a site, stage and shape (KitError if it cannot
    run there), under the name it would have."""
    profile = slurm.load_site(site)
    if gpus > profile["gpus_per_node"]:
        raise KitError(f"{site} has {profile['gpus_per_node']} GPU(s) per node, not {gpus}")
    topology = slurm.Topology(nodes, gpus)
    problem = slurm.topology_problem(stage, profile, topology)
    if problem:
        raise KitError(problem)
    name = f"batchfiles/{site}/batch-{stage}-{topology.name}.sh"
    return (f"<b>{name}</b><pre style='font-size:small'>"
            f"{html.escape(slurm.training_job(stage, topology, profile))}</pre>")


def batchfile_builder(site="ci", stage="ddp"):
    """Site, stage, nodes and GPUs per node in; the generated batch file out."""
    return calculator({
        "site": w.Dropdown(options=slurm.site_names(), value=site, description="site"),
        "stage": w.Dropdown(options=slurm.training_stages(), value=stage, description="stage"),
        "nodes": w.IntSlider(value=1, min=1, max=16, description="nodes"),
        "gpus": w.IntSlider(value=1, min=1, max=8, description="GPUs per node"),
    }, batchfile_text)


# --- live training monitor -----------------------------------------------------------------------

class TrainingMonitor:
    """Follows a run directory's metrics.jsonl: a progress bar over the run's steps, the last
    step's numbers, and loss and tokens/s plots. Display ``monitor.widget``, then ``follow`` a
    local process or a Slurm job until it ends (or call ``update`` yourself)."""

    def __init__(self, run_dir, max_steps=None):
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.progress = w.IntProgress(value=0, min=0, max=1, description="steps")
        self.status = w.HTML("waiting for the first step")
        self.plots = w.HTML()
        self.widget = w.VBox([self.progress, self.status, self.plots])
        self.records = []

    def total_steps(self):
        """The run's --max-steps, from its config.json once the script has written it."""
        if self.max_steps is None and (self.run_dir / "config.json").exists():
            self.max_steps = runs.read_json(self.run_dir / "config.json").get("max_steps")
        return self.max_steps

    def update(self):
        """Read the metrics again and redraw; returns the number of steps recorded."""
        self.records = runs.read_metrics(self.run_dir)
        if not self.records:
            return 0
        last = self.records[-1]
        self.progress.max = max(self.total_steps() or last["step"], last["step"], 1)
        self.progress.value = last["step"]
        self.status.value = (f"step {last['step']:,} of {self.progress.max:,}: loss "
                             f"{last['loss']:.4f}, {last.get('tok_per_s', 0):,.0f} tokens/s")
        self.plots.value = figure_html(self.figure())
        return len(self.records)

    def figure(self):
        fig = Figure(figsize=(8, 2.6))
        loss, speed = fig.subplots(1, 2)
        steps = [r["step"] for r in self.records]
        loss.plot(steps, [r["loss"] for r in self.records], label="training")
        validation = [r for r in self.records if "val_loss" in r]
        loss.plot([r["step"] for r in validation], [r["val_loss"] for r in validation], "o-",
                  label="validation")
        loss.set_xlabel("step")
        loss.set_ylabel("loss")
        loss.legend()
        speed.plot(steps, [r.get("tok_per_s", 0) for r in self.records])
        speed.set_xlabel("step")
        speed.set_ylabel("tokens/s")
        fig.tight_layout()
        return fig

    def follow(self, process=None, job_id=None, interval=2.0):
        """Update every ``interval`` seconds until the local ``process`` (a Popen) exits or the
        Slurm job ``job_id`` leaves the queue; returns the process's exit code, if any."""
        if (process is None) == (job_id is None):
            raise KitError("follow a local process or a Slurm job id: give one of them")
        while (process.poll() is None) if process is not None else job_in_queue(job_id):
            self.update()
            time.sleep(interval)
        self.update()
        return None if process is None else process.returncode


def job_in_queue(job_id):
    """Whether Slurm still lists the job (pending, running or completing)."""
    listed = subprocess.run(["squeue", "--noheader", "--jobs", str(job_id), "--format", "%i"],
                            capture_output=True, text=True)
    return str(job_id) in listed.stdout.split()
