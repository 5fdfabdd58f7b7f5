"""Fine-tune a pretrained language model to follow instructions: the "lora" stage of the course.

    python -m coursekit instruct prepare --out data/instruct
    python -m coursekit export-hf runs/std-tiny models/kit-tiny   # the kit's own GPT, offline
    accelerate launch --config_file solutions/accelerate/single.yaml \\
        solutions/finetune_lora.py --model models/kit-tiny --data data/instruct --out runs/lora-tiny

On a cluster --model is any Hugging Face causal language model (openai-community/gpt2,
HuggingFaceTB/SmolLM2-135M, ...) and --data any data set in the Alpaca schema, by name; both are
read from the local cache when HF_HUB_OFFLINE=1, as on compute nodes without internet.

LoRA freezes every pretrained weight W and learns a low-rank update beside it:
    y = W x + (alpha / r) * B A x        A: r x d_in, B: d_out x r, r << d
B starts at zero, so step 0 is exactly the pretrained model, and only A and B need gradients and
optimiser state. --method full trains every weight instead, for comparison.

Accelerate launches it: the same code trains on one device, with DDP, FSDP or DeepSpeed ZeRO,
chosen by the config file (solutions/accelerate/*.yaml), not by the script.
"""
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.utils import (DataLoaderConfiguration, DistributedType,
                              GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed)

from coursekit import KitError, faults, hub, instruct, perf, runs, tracking, training
from coursekit.instruct import format_prompt  # the template the tasks are read in
from coursekit.cli import ArgumentParser, positive_float, positive_int

STAGE = "lora"
#: the dtype the matmuls run in under each --precision: the peak FLOP/s the MFU is measured against
MATMUL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


# ----------------------------------------------------------------------------------------------
# Defaults per preset: which pretrained model, how big a batch, how many steps
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinetuneDefaults:
    model: str  # a local directory or a hub id
    micro_batch: int  # examples per forward pass on each process
    batch_size: int  # examples per optimiser step, all processes together
    max_len: int  # tokens per example, prompt and answer (longer ones are cut)
    max_steps: int
    lr: float
    eval_interval: int
    eval_examples: int  # validation examples scored by exact match
    ckpt_interval: int
    target_modules: str  # the layers that get adapters
    lora_dropout: float  # dropout on the adapters' input


# Every linear layer of the blocks and, unlike PEFT's "all-linear", the token embedding and the
# output head too. At the answer position the tiny model's hidden states already encode the
# answer (a linear probe reads the type at 93%), but they differ between inputs by only ~2% of
# their length (cosine 0.9996), and its frozen 64-wide output embedding cannot make a rare answer
# word likely (the best hidden state gives "int" a log-probability of -6). Adapters on the blocks
# alone learn nothing (0%); on the head too they learn the answers' marginal distribution (13%);
# with the embedding as well, the inputs' tokens become distinct enough to answer from (~75-85%).
# Both wte and lm_head are adapted, so the model must be exported with untied embeddings
# (export-hf --untie): merging an adapter into a tied matrix would change both at once.
KIT_MODEL_TARGETS = "c_attn,c_proj,c_fc,wte,lm_head"

PRESETS = {
    # the kit's own GPT from the std stage, exported by `python -m coursekit export-hf`
    "tiny": FinetuneDefaults("models/kit-tiny", micro_batch=16, batch_size=32, max_len=64,
                             max_steps=250, lr=5e-3, eval_interval=50, eval_examples=100,
                             ckpt_interval=50, target_modules=KIT_MODEL_TARGETS,
                             lora_dropout=0.0),  # 0.05 cost it 20 points of exact match
    "small": FinetuneDefaults("models/kit-small", micro_batch=16, batch_size=32, max_len=64,
                              max_steps=300, lr=1e-3, eval_interval=50, eval_examples=200,
                              ckpt_interval=100, target_modules=KIT_MODEL_TARGETS,
                              lora_dropout=0.0),
    # GPT-2 small from the hub: the same shape as the kit's gpt2-124m preset
    "gpt2-124m": FinetuneDefaults("openai-community/gpt2", micro_batch=16, batch_size=64,
                                  max_len=512, max_steps=1000, lr=2e-4, eval_interval=200,
                                  eval_examples=200, ckpt_interval=200,
                                  target_modules="all-linear", lora_dropout=0.05),
}


# ----------------------------------------------------------------------------------------------
# Data: the prompt template, prompt tokens masked out of the loss
# ----------------------------------------------------------------------------------------------
def tokenize_example(tokenizer, example, max_len):
    """Token ids of prompt + answer + end-of-text, and labels that are -100 (ignored by the loss)
    on the prompt: the model is taught to answer, not to repeat instructions."""
    prompt = tokenizer(format_prompt(example))["input_ids"]
    answer = tokenizer(example["output"])["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_len]
    labels = ([-100] * len(prompt) + answer)[:max_len]
    return {"input_ids": ids, "labels": labels}


def tokenize_all(tokenizer, examples, max_len):
    """Tokenized examples, leaving out those whose prompt fills --max-len: nothing to learn."""
    tokenized = (tokenize_example(tokenizer, e, max_len) for e in examples)
    return [t for t in tokenized if any(label != -100 for label in t["labels"])]


def collate(pad_id):
    """Pad a list of tokenized examples on the left to the longest of them: every answer then
    ends at the last position, as in generation. Positions count from each example's first real
    token, so padding does not shift them."""
    def pad(examples):
        longest = max(len(e["input_ids"]) for e in examples)
        batch = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": []}
        for e in examples:
            gap, length = longest - len(e["input_ids"]), len(e["input_ids"])
            batch["input_ids"].append([pad_id] * gap + e["input_ids"])
            batch["labels"].append([-100] * gap + e["labels"])
            batch["attention_mask"].append([0] * gap + [1] * length)
            batch["position_ids"].append([0] * gap + list(range(length)))
        return {name: torch.tensor(rows) for name, rows in batch.items()}
    return pad


def answer_loss(model, batch):
    """(each example's summed cross-entropy over its answer tokens, the positions the head ran
    on). The output head, 50,257 logits per position and most of a small model's work, runs only
    on the last positions, where the left-padded answers are; logits at t predict token t+1."""
    labels = batch["labels"]
    keep = int((labels != -100).sum(dim=1).max()) + 1
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=keep).logits
    targets = labels[:, -keep + 1:]
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                             ignore_index=-100, reduction="none")  # 0 where ignored
    return losses.view(targets.shape).sum(dim=1), logits.shape[0] * logits.shape[1]


def microbatches(accelerator, loader, start):
    """Micro-batches without end, each epoch in its own seeded order, after the first ``start``:
    a resumed run sees exactly the batches the interrupted one would have seen."""
    epoch, skip = divmod(start, len(loader))
    while True:
        loader.set_epoch(epoch)
        yield from accelerator.skip_first_batches(loader, skip) if skip else loader
        epoch, skip = epoch + 1, 0


# ----------------------------------------------------------------------------------------------
# The model: pretrained weights, then LoRA adapters (or every weight trainable)
# ----------------------------------------------------------------------------------------------
def load_pretrained(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    repository, revision = hub.name_and_revision(name)  # the hub's at a pinned commit
    try:
        tokenizer = AutoTokenizer.from_pretrained(repository, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(repository, revision=revision,
                                                     dtype=torch.float32)
    except OSError as err:  # not a directory, not on the hub, or offline with an empty cache
        raise KitError(f"cannot load --model {name} ({' '.join(str(err).split())[:160]}): give "
                       "a model directory (python -m coursekit export-hf) or a hub id that is in "
                       "the cache") from None
    if tokenizer.pad_token is None:  # GPT-2 has no padding token; padded positions are masked
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def add_lora(model, args):
    from peft import LoraConfig, get_peft_model
    targets = args.target_modules if isinstance(args.target_modules, list) else []
    if model.config.tie_word_embeddings and {"wte", "lm_head"} & set(targets):
        raise KitError(f"--model {args.model} ties its input embedding to its output head: "
                       "merging an adapter of either would change both; export the model with "
                       "`python -m coursekit export-hf --untie`, or leave wte and lm_head out of "
                       "--target-modules")
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=args.target_modules, task_type="CAUSAL_LM",
        # GPT-2 stores its projections as Conv1D, whose weight is the transpose of nn.Linear's
        fan_in_fan_out=model.config.model_type == "gpt2")
    return get_peft_model(model, config)


def full_size(parameter):
    """A parameter's number of values; ZeRO-3 partitions weights as they load, and ds_numel keeps
    the full size."""
    return getattr(parameter, "ds_numel", parameter.numel())


def count_parameters(model):
    sizes = [(full_size(p), p.requires_grad) for p in model.parameters()]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)


def matmul_weights(model):
    """(weights in the matmuls that every token goes through, weights of the output head); the
    embeddings are look-ups, not matmuls."""
    embeddings = {id(m.weight): full_size(m.weight) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings().weight
    untied_head = 0 if id(head) in embeddings else full_size(head)
    everything = sum(full_size(p) for p in model.parameters())
    return everything - sum(embeddings.values()) - untied_head, full_size(head)


def make_accelerator(args):
    """Accelerate reads the launch config (DDP, FSDP, DeepSpeed) from the environment that
    `accelerate launch` sets; here only what a CPU-only machine needs on top of it."""
    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    if on_cpu and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        # Accelerate applies FSDP only when it finds accelerators; on a CPU-only laptop or CI
        # machine, let its process state treat the gloo processes as data-parallel devices so
        # the same FSDP config shards over them as it does over GPUs.
        PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU
    return Accelerator(
        cpu=on_cpu and not deepspeed,  # DeepSpeed brings its own CPU support
        mixed_precision=args.precision,
        # micro-batches run on across epochs: accumulate by count, not up to an epoch's end
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.grad_accum, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # on a CPU DeepSpeed would ask for Intel's oneCCL; gloo is what every torch build has
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if on_cpu and deepspeed else [])


# ----------------------------------------------------------------------------------------------
# Evaluation: loss on the answers, and exact match of greedy answers
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def validation_loss(accelerator, model, loader):
    """Mean loss per answer token over the whole validation split, every process a share.
    Accelerate repeats a few examples so that every process gets as many batches;
    gather_for_metrics leaves the repeats out."""
    total, count = 0.0, 0
    for batch in loader:
        losses, _ = answer_loss(model, batch)
        tokens = (batch["labels"] != -100).sum(dim=1)
        losses, tokens = accelerator.gather_for_metrics((losses, tokens))
        total, count = total + losses.sum().item(), count + tokens.sum().item()
    return total / count


def normalise(text):
    return text.split("\n")[0].strip().lower()


@torch.no_grad()
def greedy_answers(accelerator, model, tokenizer, examples, max_new_tokens, batch_size):
    """The model's answer to each example, generated greedily from the prompt."""
    generator = accelerator.unwrap_model(model)
    # sharded models (FSDP, ZeRO-3) need every process in every forward pass until all are done
    synced = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    answers = []
    for start in range(0, len(examples), batch_size):
        prompts = [format_prompt(e) for e in examples[start:start + batch_size]]
        # left padding: every prompt ends where the answer begins
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        out = generator.generate(**inputs.to(accelerator.device), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 synced_gpus=synced and accelerator.num_processes > 1)
        answers += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    return answers


def gather_texts(accelerator, texts):
    """Every process's list of strings, concatenated in process order. They travel as UTF-8
    JSON in a tensor: an object collective (gather_object) would unpickle whatever another
    process sent."""
    encoded = torch.tensor(list(json.dumps(texts).encode()), dtype=torch.uint8,
                           device=accelerator.device)
    sizes = accelerator.gather(torch.tensor([len(encoded)], device=accelerator.device)).tolist()
    rows = accelerator.gather(accelerator.pad_across_processes(encoded)).view(len(sizes), -1)
    return [text for row, size in zip(rows, sizes)
            for text in json.loads(bytes(row[:size].tolist()).decode())]


def exact_match(accelerator, model, tokenizer, examples, args):
    """Fraction of answers equal to the reference (first line, case and spaces aside), overall
    and per task; and the predictions. Every process answers its share of the examples."""
    with accelerator.split_between_processes(examples) as unpadded:
        share = len(unpadded)  # padding repeats this process's last example: not sent back
    with accelerator.split_between_processes(examples, apply_padding=True) as mine:
        answers = greedy_answers(accelerator, model, tokenizer, mine, args.answer_tokens,
                                 args.micro_batch)
    answers = gather_texts(accelerator, answers[:share])  # in the order of the examples
    scored = [{"task": e.get("task", "all"), "input": e["input"], "reference": e["output"],
               "answer": a, "correct": normalise(a) == normalise(e["output"])}
              for e, a in zip(examples, answers, strict=True)]
    by_task = {}
    for s in scored:
        by_task.setdefault(s["task"], []).append(s["correct"])
    return (sum(s["correct"] for s in scored) / len(scored),
            {task: sum(c) / len(c) for task, c in sorted(by_task.items())}, scored)


def evaluate(accelerator, model, tokenizer, val_loader, val_examples, args):
    model.eval()
    result = {"val_loss": validation_loss(accelerator, model, val_loader)}
    result["exact_match"], result["exact_match_by_task"], predictions = exact_match(
        accelerator, model, tokenizer, val_examples, args)
    model.train()
    return result, predictions


# ----------------------------------------------------------------------------------------------
# Checkpoints and the final models
# ----------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, run_dir, step):
    """Every process writes its part (Accelerate: model and optimiser shards, RNG states); the
    main process then publishes the directory in one rename (coursekit.runs)."""
    tmp = runs.unpublished_checkpoint(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        runs.write_json_atomic(tmp / "kit_state.json", {"step": step})
        runs.publish_checkpoint(run_dir, step)
    accelerator.wait_for_everyone()


def resume(accelerator, run_dir):
    """Restore the newest checkpoint, if any; return the number of steps already done."""
    path = runs.checkpoint_to_resume(run_dir)
    if path is None:
        accelerator.print(f"no checkpoint in {run_dir}: starting from step 0")
        return 0
    accelerator.load_state(path)  # tensors from safetensors; the rest with weights_only=True
    step = runs.read_json(path / "kit_state.json")["step"]
    accelerator.print(f"resumed from {path} at step {step}")
    return step


def save_final_models(accelerator, model, tokenizer, run_dir, args):
    """LoRA: the adapters alone (RUN_DIR/adapter, megabytes) and the pretrained model with the
    adapters merged into its weights (RUN_DIR/model). Full fine-tuning: RUN_DIR/model."""
    state = accelerator.get_state_dict(model)  # gathers FSDP / ZeRO-3 shards on the main process
    unwrapped = accelerator.unwrap_model(model)
    if not accelerator.is_main_process:
        pass
    elif args.method == "full":
        write_model_dir(run_dir / "model", lambda d: (
            unwrapped.save_pretrained(d, state_dict=state), tokenizer.save_pretrained(d)))
    else:
        write_model_dir(run_dir / "adapter", lambda d: (
            # the adapters only: the embedding matrices stay in the base model (PEFT would copy
            # them whenever an embedding is adapted, in case the vocabulary was resized)
            unwrapped.save_pretrained(d, state_dict=state, save_embedding_layers=False),
            tokenizer.save_pretrained(d)))
        write_model_dir(run_dir / "model",
                        lambda d: merge_adapter(args.model, run_dir / "adapter", d))
    accelerator.wait_for_everyone()


def merge_adapter(base_name, adapter_dir, out_dir):
    """W' = W + (alpha / r) B A for every adapted weight: a plain model again, as fast as the base
    model at inference and loadable without PEFT."""
    from peft import PeftModel
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    # under ZeRO-3 transformers would build the model partitioned over processes that have
    # finished: this copy belongs to the main process alone
    unset_hf_deepspeed_config()
    base, tokenizer = load_pretrained(base_name)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def write_model_dir(final, write):
    """Write a model directory next to its final place, then rename it there."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="defaults below (default: gpt2-124m on a GPU, tiny on a CPU)")
    parser.add_argument("--model", help="pretrained model: a local directory or a hub id")
    parser.add_argument("--data", default="data/instruct",
                        help="directory of train.jsonl/val.jsonl, or a hub data set name")
    parser.add_argument("--out", help=f"run directory (default: runs/{STAGE}-<preset>)")
    parser.add_argument("--max-steps", type=positive_int, help="optimiser steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run directory's newest checkpoint, if it has one")
    parser.add_argument("--method", choices=["lora", "full"], default="lora",
                        help="train LoRA adapters, or every weight")
    parser.add_argument("--lora-r", type=positive_int, default=8, help="rank of the update")
    parser.add_argument("--lora-alpha", type=positive_float, default=16.0,
                        help="scale: the update is multiplied by alpha / r")
    parser.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input")
    parser.add_argument("--target-modules",
                        help="comma-separated module names to adapt, or all-linear")
    parser.add_argument("--micro-batch", type=positive_int, help="examples per forward pass")
    parser.add_argument("--batch-size", type=positive_int,
                        help="examples per optimiser step, all processes together")
    parser.add_argument("--max-len", type=positive_int, help="tokens per example")
    parser.add_argument("--lr", type=positive_float, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    parser.add_argument("--eval-interval", type=positive_int, help="steps between validations")
    tracking.add_argument(parser)
    parser.add_argument("--eval-examples", type=positive_int,
                        help="validation examples answered and scored by exact match")
    parser.add_argument("--answer-tokens", type=positive_int, default=8,
                        help="longest answer generated in evaluation")
    parser.add_argument("--ckpt-interval", type=positive_int, help="steps between checkpoints")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "no"], default="auto",
                        help="mixed precision (auto: bf16 where the GPU has it in hardware, fp16 on "
                             "older GPUs, else fp32)")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except KitError as err:
        parser.error(str(err))
    return args


def check_args(args):
    """Fill preset defaults, then refuse combinations that cannot work, saying why."""
    preset_name = args.preset or ("gpt2-124m" if torch.cuda.is_available() else "tiny")
    args.preset, defaults = preset_name, PRESETS[preset_name]
    for name in ("model", "batch_size", "max_len", "max_steps", "lr",
                 "eval_interval", "eval_examples", "ckpt_interval", "target_modules",
                 "lora_dropout"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    if args.warmup_steps is None:
        args.warmup_steps = args.max_steps // 10
    if args.precision == "auto":  # what the GPU computes fast (Accelerate scales fp16's loss)
        gpu = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        hardware = training.device_precision(gpu)
        args.precision = "no" if hardware == "fp32" else hardware
    args.out = args.out or f"runs/{STAGE}-{args.preset}"
    if "," in args.target_modules:
        args.target_modules = [m.strip() for m in args.target_modules.split(",") if m.strip()]
    if not 0 <= args.lora_dropout < 1:
        raise KitError(f"--lora-dropout {args.lora_dropout} must be at least 0 and below 1")
    if not 0 <= args.warmup_steps <= args.max_steps:
        raise KitError(f"--warmup-steps {args.warmup_steps} must be between 0 and --max-steps "
                       f"({args.max_steps})")
    processes = int(os.environ.get("WORLD_SIZE", 1))  # set by the launcher
    if args.micro_batch is None:  # the preset's, made smaller until the processes share evenly
        fitting = [m for m in range(defaults.micro_batch, 0, -1)
                   if args.batch_size % (m * processes) == 0]
        if not fitting:
            raise KitError(f"--batch-size {args.batch_size} cannot be shared evenly by "
                           f"{processes} processes: use a multiple of {processes}")
        args.micro_batch = fitting[0]
    per_step = args.micro_batch * processes
    if args.batch_size % per_step:
        raise KitError(f"--batch-size {args.batch_size} is not a multiple of micro-batch x "
                       f"processes = {args.micro_batch} x {processes} = {per_step}")
    args.grad_accum = args.batch_size // per_step
    if Path(args.model).exists() or args.model.startswith((".", "/")):  # a path, not a hub id
        if not (Path(args.model) / "config.json").is_file():
            raise KitError(f"cannot load --model {args.model}: not a model directory (no "
                           "config.json); export one with `python -m coursekit export-hf`")
    instruct.local_files(args.data)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KitError(f"--out {out} is a file, not a run directory")
    if runs.latest_checkpoint(out) is not None and not args.resume:
        raise KitError(f"{out} already holds a checkpoint: pass --resume to continue that run, "
                       "or choose another --out")


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    if accelerator.device.type == "cpu":
        perf.keep_freed_cpu_memory()  # reuse freed tensors' pages instead of re-faulting them
    set_seed(args.seed)  # the same adapters' initial values on every process
    run_dir = Path(args.out)

    model, tokenizer = load_pretrained(args.model)
    blocks, head = matmul_weights(model)
    if args.method == "lora":
        model = add_lora(model, args)
    trainable, total = count_parameters(model)
    accelerator.print(f"{accelerator.distributed_type.value} on {accelerator.num_processes} "
                      f"process(es), device {accelerator.device}, precision {args.precision}")
    accelerator.print(f"model {args.model}: {total:,} parameters, {args.method}: "
                      f"{trainable:,} trainable ({100 * trainable / total:.2f}%)")

    train_examples, val_examples = instruct.load_splits(args.data)
    val_scored = [val_examples[i] for i in range(min(args.eval_examples, len(val_examples)))]
    pad = collate(tokenizer.pad_token_id)
    train_loader = torch.utils.data.DataLoader(
        tokenize_all(tokenizer, train_examples, args.max_len),
        batch_size=args.micro_batch, shuffle=True, collate_fn=pad, drop_last=True)
    val_loader = torch.utils.data.DataLoader(
        tokenize_all(tokenizer, val_examples, args.max_len),
        batch_size=args.micro_batch, collate_fn=pad)
    accelerator.print(f"data {args.data}: {len(train_examples):,} training and "
                      f"{len(val_examples):,} validation examples | micro-batch {args.micro_batch} "
                      f"x {accelerator.num_processes} process(es) x grad_accum {args.grad_accum} "
                      f"= {args.batch_size} examples per step")

    from transformers import get_cosine_schedule_with_warmup
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=0.0 if args.method == "lora" else 0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    # the schedule is not handed to Accelerate, which would step it once per process per step
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader)

    # FLOPs per weight and token: 2 forward, 2 backward for the input's gradient, 2 more for the
    # weight's gradient where weights train (full fine-tuning); LoRA's adapters are negligible
    per_weight = 4 if args.method == "lora" else 6
    peak, peak_source = perf.peak_flops(accelerator.device, MATMUL_DTYPES[args.precision])
    runs.make_run_dir(run_dir)
    start_step = resume(accelerator, run_dir) if args.resume else 0
    for _ in range(start_step):  # the schedule depends on the step alone: replaying it is exact
        scheduler.step()
    if accelerator.is_main_process:
        runs.start_run(run_dir, {
            "stage": STAGE, "args": vars(args), "parameters": total, "trainable": trainable,
            "trainable_fraction": trainable / total, "world_size": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "matmul_weights": {"blocks": blocks, "head": head}, "peak_flops": peak,
            "peak_source": peak_source,
            "device": str(accelerator.device), "torch": torch.__version__}, start_step)
    tracker = tracking.start(args.track, run_dir, resumed=start_step > 0)

    if start_step == 0:
        before, _ = evaluate(accelerator, model, tokenizer, val_loader, val_scored, args)
        report_evaluation(accelerator, run_dir, "before", before)

    stop, done, last_eval = training.StopSignal(), start_step, None
    batches = microbatches(accelerator, train_loader, start_step * args.grad_accum)
    model.train()
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=accelerator.device)
        tokens = torch.zeros((), device=accelerator.device)
        flops = torch.zeros((), device=accelerator.device, dtype=torch.float64)
        micro_batches = [next(batches) for _ in range(args.grad_accum)]
        # The loss is the mean over the minibatch's answer tokens, on every process together. A
        # mean per micro-batch would weigh a token by how many answer tokens share its micro-
        # batch, so 2 micro-batches of 16 and 4 processes of 8 would train different models.
        answer_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches))
        # backward divides by the micro-batches and the gradients are averaged over the processes
        scale = args.grad_accum * accelerator.num_processes / answer_tokens
        for batch in micro_batches:
            with accelerator.accumulate(model):  # gradients are reduced on the last micro-batch
                losses, rows = answer_loss(model, batch)
                total = losses.sum()
                accelerator.backward(total * scale)
                if accelerator.sync_gradients:
                    clipped = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # Accelerate skips it until the last micro-batch
                optimizer.zero_grad()
            loss_sum += total.detach()
            tokens += batch["attention_mask"].sum()
            flops += per_weight * (blocks * batch["attention_mask"].sum() + head * rows)
        scheduler.step()
        grad_norm = norm_before_clipping(accelerator, model, clipped)
        loss_value = (accelerator.reduce(loss_sum) / answer_tokens).item()  # waits for devices
        dt = time.perf_counter() - t0
        tokens_per_s = accelerator.reduce(tokens).item() / dt
        mfu = accelerator.reduce(flops).item() / dt / (peak * accelerator.num_processes)

        done = step + 1
        record = {"step": done, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "ms": dt * 1000, "tok_per_s": tokens_per_s,
                  "mfu": mfu,
                  "epoch": done * args.batch_size / len(train_examples)}
        line = (f"step {done}/{args.max_steps} | loss {loss_value:.4f} | lr {record['lr']:.1e} | "
                f"grad_norm {grad_norm:.2f} | {record['ms']:.1f} ms | {tokens_per_s:,.0f} tok/s | "
                f"mfu {100 * record['mfu']:.1f}%")
        if done % args.eval_interval == 0 or done == args.max_steps:
            last_eval = evaluate(accelerator, model, tokenizer, val_loader, val_scored, args)
            result = last_eval[0]
            record.update(val_loss=result["val_loss"], exact_match=result["exact_match"])
            line += f" | val {result['val_loss']:.4f} | exact match {result['exact_match']:.1%}"
        accelerator.print(line, flush=True)
        if accelerator.is_main_process:
            runs.append_metrics(run_dir, record)
        tracker.log_step(record)

        # every process stops at the same step if any of them was signalled
        flag = torch.tensor(float(stop.received is not None), device=accelerator.device)
        stopping = accelerator.reduce(flag).item() > 0
        if done % args.ckpt_interval == 0 or done == args.max_steps or stopping:
            save_checkpoint(accelerator, run_dir, done)
        if stopping and done < args.max_steps:
            accelerator.print(stop.stopped_line(done), flush=True)
            break

    if done == args.max_steps:
        if last_eval is None:  # resumed from the final checkpoint: nothing trained, still report
            last_eval = evaluate(accelerator, model, tokenizer, val_loader, val_scored, args)
        report_evaluation(accelerator, run_dir, "after", *last_eval)
        save_final_models(accelerator, model, tokenizer, run_dir, args)
    final = run_dir / ("adapter" if args.method == "lora" else "model")
    tracker.finish(run_dir, final if done == args.max_steps else None)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def norm_before_clipping(accelerator, model, clipped):
    """The gradients' global norm. DeepSpeed clips inside its own step (gradient_clipping in its
    config) and reports the norm afterwards; FSDP returns it as a DTensor."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return float(model.get_global_grad_norm())
    return float(clipped.full_tensor() if hasattr(clipped, "full_tensor") else clipped)


def report_evaluation(accelerator, run_dir, when, result, predictions=None):
    """Print an evaluation; keep it in RUN_DIR/eval.json (before and after training) and the
    answers of the last one in RUN_DIR/predictions.jsonl."""
    by_task = ", ".join(f"{t} {v:.1%}" for t, v in result["exact_match_by_task"].items())
    accelerator.print(f"{when} training: val loss {result['val_loss']:.4f} | exact match "
                      f"{result['exact_match']:.1%} ({by_task})", flush=True)
    if not accelerator.is_main_process:
        return
    path = run_dir / "eval.json"
    evaluations = runs.read_json(path) if path.exists() else {}
    runs.write_json_atomic(path, {**evaluations, when: result})
    if predictions is not None:
        lines = "".join(json.dumps(p) + "\n" for p in predictions)
        tmp = run_dir / ".predictions.jsonl.tmp"
        tmp.write_text(lines)
        os.replace(tmp, run_dir / "predictions.jsonl")


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
