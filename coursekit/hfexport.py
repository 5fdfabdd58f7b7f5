"""A trained run as a Hugging Face GPT-2 model: ``python -m coursekit export-hf RUN_DIR OUT_DIR``.

Lesson 05 fine-tunes with PEFT and Accelerate, which start from a directory that
``GPT2LMHeadModel.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read, offline. This module
writes one from the newest checkpoint of a std, ddp or fsdp run:

    OUT_DIR/config.json, generation_config.json, model.safetensors    the model
    OUT_DIR/tokenizer.json, tokenizer_config.json, vocab.json, ...    GPT-2's tokenizer
    OUT_DIR/kit_export.json                                           run, stage, step, checkpoint

The kit's GPT already uses Hugging Face's parameter names; two things differ and are bridged here:

* Layout. The kit's projections are ``nn.Linear`` (weight: out x in). Hugging Face's GPT-2 keeps
  OpenAI's ``Conv1D`` (weight: in x out), so c_attn, c_proj and c_fc weights are transposed.
* Vocabulary. The kit pads the vocabulary to 50,304 rows for faster matmuls; the 47 extra rows are
  no token (the tokenizer never produces them), so the tied embedding is cut back to GPT-2's
  50,257 and the export is shaped like the hub's GPT-2.

``--untie`` writes the output head as a matrix of its own (a copy of the embedding, so the model
computes the same logits). Lesson 05 adapts both with LoRA: merging an adapter into a tied matrix
would change the input embedding and the output head at once.

std and ddp checkpoints are safetensors (ddp saves the unwrapped model: no "module." prefix).
fsdp checkpoints are DCP directories of per-rank shards, reassembled here in one process without a
process group, so an export needs no torchrun and no more memory than one full model.
"""
import os
import shutil
import warnings
from pathlib import Path

import torch

from coursekit import KitError, __version__, data, runs
from coursekit.presets import GPT2_VOCAB

SUPPORTED_STAGES = ("std", "ddp", "fsdp", "tp", "pp")
SHARDED_STAGES = ("fsdp", "tp", "pp")  # their checkpoints: every rank's part, in DCP's format
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
VOCAB_ROWS = ("transformer.wte.weight", "lm_head.weight")  # one tied matrix, under both names
# the files of tiktoken's cache under the names Hugging Face's GPT-2 tokenizer reads
HF_TOKENIZER_NAMES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
# spaces, digits, punctuation, accents, code and the end-of-text token: where BPE set-ups differ
TOKENIZER_PROBE = ("Hello world!  Ünïcödé café, 1234567 tokens\n\tdef f(x): return x**2 # ok"
                   "<|endoftext|> The end")


def export(run_dir, out_dir, force=False, untie=False):
    """Write the Hugging Face model directory ``out_dir`` from ``run_dir``'s newest checkpoint;
    return the provenance record that kit_export.json holds."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    config, checkpoint = read_run(run_dir)
    check_out_dir(out_dir, run_dir, force)
    cache = tokenizer_cache()  # fail before the slow part, not after it
    step, kit_state = load_model_state(config["stage"], checkpoint)
    record = {"run_dir": str(run_dir.resolve()), "stage": config["stage"], "step": step,
              "checkpoint": str(checkpoint.resolve()),
              "vocab_size": GPT2_VOCAB, "padded_vocab_size": config["model"]["vocab_size"],
              "untied": untie, "coursekit": __version__, "torch": torch.__version__}
    # built next to OUT_DIR, then renamed onto it: never a half-written model directory
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        record["transformers"] = save_model(hf_state_dict(kit_state), config["model"], tmp,
                                            untie)
        save_tokenizer(cache, config["model"]["block_size"], tmp)
        runs.write_json_atomic(tmp / "kit_export.json", record)
        publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


# --- checks ------------------------------------------------------------------------------------

def read_run(run_dir):
    """(config, newest checkpoint) of a run directory of a supported stage, or a KitError."""
    if not run_dir.is_dir():
        raise KitError(f"run directory {run_dir} does not exist")
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise KitError(f"{run_dir} has no config.json: not a run directory of a stage script")
    config = runs.read_json(config_path)
    stage = config.get("stage")
    if stage not in SUPPORTED_STAGES:
        raise KitError(f"{run_dir} is a run of stage {stage!r}: export-hf reads std, ddp, fsdp, tp "
                       "and pp runs (Lightning's checkpoints are not supported)")
    checkpoint = runs.checkpoint_to_resume(run_dir)  # fsdp checkpoints unpickle .metadata
    if checkpoint is None or not checkpoint.is_dir():
        raise KitError(f"{run_dir} has no checkpoint (ckpt/step_*): a run saves one every "
                       "--ckpt-interval steps and at its last step")
    return config, checkpoint


def check_out_dir(out_dir, run_dir, force):
    if out_dir.exists() and not out_dir.is_dir():
        raise KitError(f"OUT_DIR {out_dir} is a file: choose a directory")
    if out_dir.resolve() in (run_dir.resolve(), *run_dir.resolve().parents):
        raise KitError(f"OUT_DIR {out_dir} holds the run directory {run_dir}, which replacing it "
                       "would delete: choose another OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise KitError(f"OUT_DIR {out_dir} exists and is not empty: pass --force to replace it, "
                       "or choose another OUT_DIR")


def tokenizer_cache():
    cache = data.tiktoken_cache_dir()
    if not data.tokenizer_available_offline(cache):
        raise KitError(f"the GPT-2 tokenizer files are not in {cache}: run "
                       "`python -m coursekit tokenizer fetch`")
    return cache


# --- weights -----------------------------------------------------------------------------------

def load_model_state(stage, checkpoint):
    """(step, the kit model's full state_dict on the CPU) of ``checkpoint``, a run's newest
    intact one."""
    if stage in SHARDED_STAGES:
        return runs.checkpoint_step(checkpoint), load_sharded_model_state(checkpoint)
    step, state = runs.read_checkpoint(checkpoint)
    return step, state["model"]


def load_sharded_model_state(checkpoint):
    """Reassemble the model from a sharded checkpoint (FSDP's shards, TP's slices, PP's stages):
    the metadata gives every tensor's full shape, and dcp.load without a process group fills
    whole tensors from all ranks' files."""
    from coursekit import dcp_data  # its pickles read as data: no code in them runs

    shapes = dcp_data.DataOnlyReader(checkpoint).read_metadata().state_dict_metadata
    model = {name.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in shapes.items() if name.startswith("model.")}
    state = {"model": model}  # the optimiser's shards are left on disk
    with warnings.catch_warnings():  # one process without a group is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_data.load(state, checkpoint, no_dist=True)
    return state["model"]


def fused_attention(kit_state):
    """The kit's separate q, k and v projections as GPT-2's one c_attn: their rows stacked."""
    state = dict(kit_state)
    for name in [n for n in kit_state if ".attn.q_proj." in n]:
        parts = [state.pop(name.replace("q_proj", part)) for part in ("q_proj", "k_proj", "v_proj")]
        state[name.replace("q_proj", "c_attn")] = torch.cat(parts)
    return state


def hf_state_dict(kit_state):
    """The kit's weights in Hugging Face GPT-2's layout: q, k and v fused, Conv1D weights
    transposed, the tied embedding trimmed to GPT-2's vocabulary."""
    hf_state = {}
    for name, tensor in fused_attention(kit_state).items():
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        if name in VOCAB_ROWS:
            tensor = tensor[:GPT2_VOCAB]
        hf_state[name] = tensor.contiguous()
    return hf_state


def gpt2_config(model, untie=False):
    """GPT-2's configuration for the kit model's shape (config.json's "model")."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=GPT2_VOCAB, n_positions=model["block_size"], n_embd=model["n_embd"],
        n_layer=model["n_layer"], n_head=model["n_head"],
        activation_function="gelu_new",  # the tanh GELU, as the kit's nn.GELU(approximate="tanh")
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # the kit trains without dropout
        bos_token_id=data.EOT_TOKEN, eos_token_id=data.EOT_TOKEN, tie_word_embeddings=not untie)


def save_model(hf_state, model_shape, out, untie=False):
    """Write config.json, generation_config.json and the weights; return transformers' version."""
    import transformers
    from transformers import GenerationConfig, GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(model_shape, untie))
    model.load_state_dict(hf_state)  # strict: every name and shape must match GPT-2's
    if untie:  # the same values, no longer the same tensor
        model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    # GPT-2 has no padding token: generate() pads finished sequences with end-of-text
    model.generation_config = GenerationConfig(bos_token_id=data.EOT_TOKEN,
                                               eos_token_id=data.EOT_TOKEN,
                                               pad_token_id=data.EOT_TOKEN)
    model.save_pretrained(out)
    return transformers.__version__


# --- tokenizer ---------------------------------------------------------------------------------

def save_tokenizer(cache, block_size, out):
    """GPT-2's tokenizer from the two files the kit keeps for tiktoken: the same BPE vocabulary
    and merges under Hugging Face's names, so no download is needed."""
    from transformers import GPT2TokenizerFast

    for cache_name, (source, _) in data.TOKENIZER_FILES.items():
        shutil.copyfile(cache / cache_name, out / HF_TOKENIZER_NAMES[source])
    tokenizer = GPT2TokenizerFast.from_pretrained(out, model_max_length=block_size)
    tokenizer.pad_token = tokenizer.eos_token  # batches need a padding token; GPT-2 has none
    check_same_ids(tokenizer)
    tokenizer.save_pretrained(out)


def check_same_ids(tokenizer):
    """The exported tokenizer must give the ids the model was trained on (tiktoken's)."""
    expected = data.gpt2_encoding().encode(TOKENIZER_PROBE, allowed_special="all")
    if tokenizer(TOKENIZER_PROBE)["input_ids"] != expected:
        raise KitError("the Hugging Face tokenizer built from the tiktoken cache encodes text "
                       "differently from tiktoken: run `python -m coursekit tokenizer fetch`")


# --- output ------------------------------------------------------------------------------------

def publish(tmp, out_dir):
    """Rename the finished export onto OUT_DIR; an old OUT_DIR (--force, or an empty one) is moved
    aside first and deleted last, so OUT_DIR is never a mix of the two."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old)
