# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Ray on Slurm, and retrieval-augmented generation
#
# **Questions.** This lesson answers
# - How do I run Python across the nodes of a Slurm job without writing a launcher?
# - How do I keep a cluster service, like Ray's, for my own use alone?
# - How does retrieval give a language model facts it was not trained on, and how do I measure
#   it?
#
# **Objectives.** After this lesson you can
# - run Python functions and classes as Ray tasks and actors, and say where each ran;
# - start a Ray cluster inside a Slurm job that no other user of the cluster can reach, and stop
#   it cleanly at the time limit;
# - embed a corpus in parallel with Ray Data's `map_batches` over a pool of model replicas;
# - name what Ray Train and Ray Tune add to the DDP stage and to lesson 07's Optuna study;
# - build a retrieval system over documents: token chunks, BM25 and dense retrievers, a vector
#   index;
# - measure it with mean reciprocal rank and recall@k against a random baseline, and choose a
#   chunk size from the evidence and the model's context;
# - say what retrieval does for a model's answers, measured with and without it.
#
# **Prerequisites.** Lesson 02 (DDP, the process group), lesson 05 (the lora stage, the Alpaca
# prompt), lesson 07 (trials, pruning, a search space).
#
# **Time.** About 60 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.
#
# Slurm and `torchrun` start the same program on many processes. Ray starts a *cluster*
# instead: a head and a worker process on each node, to which a Python program (the driver) sends
# functions and classes to run wherever there is room. That suits work that is not one SPMD
# program: thousands of small tasks of uneven length, a pool of model replicas fed from a stream,
# a search whose trials start and stop. This lesson uses it for one such job, embedding a
# corpus, and then builds what the embeddings are for: a search over the course's own documents
# that a language model answers from.

# %%
import matplotlib.pyplot as plt
import numpy as np
import ray
from IPython.display import Markdown, display

from coursekit import KIT_ROOT, exercise, rag, raycluster

# %% [markdown]
# The set-up: the standard library's modules the lesson uses, a fresh folder for what the
# lesson writes, and the kit's documents and questions that the retrieval part searches.

# %%
import collections
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path("runs")  # what this lesson writes
shutil.rmtree(RUNS, ignore_errors=True)
RUNS.mkdir()
CORPUS = rag.documents()
QUESTIONS = rag.questions(CORPUS)
print(f"{len(CORPUS)} documents, {len(QUESTIONS)} questions")

# %% [markdown]
# ## Ray in one page
#
# `ray.init()` starts a Ray on this machine (or, inside a Ray job, joins the job's cluster).
# A function decorated with `@ray.remote` becomes a **task**: `f.remote(x)` returns at once with
# an `ObjectRef`, a promise of the result, and Ray runs the call in one of its worker processes;
# `ray.get` waits for results. A class decorated the same way becomes an **actor**: a process
# that keeps its state (a loaded model, a counter) between calls. Results live in Ray's shared
# **object store**, and an `ObjectRef` can be passed to another task without the data coming back
# to the driver.

# %% tags=["demo"]
raycluster.connect()  # a local Ray here; the job's cluster where RAY_ADDRESS is set


@ray.remote
def where(x):
    """A task: x squared, and the process and host that computed it."""
    time.sleep(0.2)
    return x * x, os.getpid(), socket.gethostname()


@ray.remote
class Tally:
    """An actor: one process, whose state outlives each call."""

    def __init__(self):
        self.seen = []

    def add(self, value):
        self.seen.append(value)
        return len(self.seen)


started = time.perf_counter()
results = ray.get([where.remote(x) for x in range(8)])
print(f"8 tasks of 0.2 s in {time.perf_counter() - started:.2f} s on "
      f"{len({pid for _, pid, _ in results})} worker processes "
      f"({ray.cluster_resources()['CPU']:.0f} "
      f"CPUs); squares {[square for square, _, _ in results]}")
tally = Tally.remote()
print("the actor has seen",
      ray.get([tally.add.remote(square) for square, _, _ in results])[-1],
      "values")

# %% [markdown]
# ## A Ray cluster inside a Slurm job
#
# On a cluster, Slurm gives the job its nodes and Ray runs inside them: the head on the first
# node, a worker on each of the others, each a step of the job (`srun`), and the driver (your
# script) on the first node. The kit's batch files do this for every site (`batch-ray-*.sh`):
#
#     sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_embed.py --workers 8
#
# Three things in them matter on a machine shared with other users.
#
# - **Ray runs whatever code a client sends it.** Anyone who can reach the head's port could
#   run programs as you. Since Ray 2.52, `RAY_AUTH_MODE=token` makes every request to the cluster
#   and its dashboard carry a token. The job writes a new one to a file only you can read, and
#   every Ray process of the job reads it; a client without it is refused (the kit's tests check
#   this on their Slurm cluster). The local Ray of this notebook has a token too (Ray turns it on
#   for a local Ray), kept in `~/.ray`: `raycluster.connect()` first makes that folder yours
#   alone, where Ray would leave the token readable by anyone who can enter your home folder.
# - **Dashboard.** Ray's web page listens on the head node's 127.0.0.1 only, on a port chosen
#   when the head starts, behind the same token. The job's log prints the port `P` and the
#   tunnel to run on your laptop, through the login node:
#   `ssh -N -J <login node> -L P:127.0.0.1:P <head node>`; then open `http://127.0.0.1:P`. Or
#   go through Open OnDemand; never open a port.
# - **Stopping.** Slurm sends SIGUSR1 180 s before the time limit: every real site's profile
#   sets `signal_seconds: 180`, which its batch files write as `#SBATCH --signal=B:USR1@180`
#   (the test cluster's file below uses 60 s, for its short jobs). The batch file passes the
#   signal to the driver, which checkpoints and stops; then the job stops every node and waits
#   for them, so no Ray process outlives the job.
#
# The file for the kit's test cluster (2 nodes of 2 CPUs):

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A Ray cluster is private because it runs inside my job.* Its ports are open to every
# user of the nodes; only the token keeps them out.
# :::

# %% tags=["demo"]
batch_file = (KIT_ROOT / "batchfiles" / "ci" / "batch-ray-2n2g.sh").read_text()
print("\n".join(line for line in batch_file.splitlines()
                if line.strip() and not line.startswith(("#!", "# shellcheck"))))

# %% [markdown]
# ## Ray Train and Ray Tune, in brief
#
# `solutions/ray_train_gpt2.py` runs the DDP stage's training loop in the workers of a Ray Train
# `TorchTrainer`: Ray starts the processes, wherever the cluster has room, makes them a process
# group and wraps the model in DDP (`prepare_model`). The rest is the DDP stage, step for step, and
# the losses are its losses at the same global batch (the kit's tests check this). What Ray adds
# is placement and restarts across a cluster it manages; what it costs is another layer between
# you and `torch.distributed`.
#
# `solutions/ray_tune_gpt2.py` tunes lesson 07's search space with the same trainer and budget.
# Its **ASHA** scheduler (asynchronous successive halving) is lesson 07's Hyperband pruning
# without brackets: a trial goes on past a rung only if it is in the best third of those that
# reached it. **Population-based training** (PBT) is new: a population of trials trains at once,
# and at each interval the worst quarter copy the weights of the best quarter (their checkpoints)
# and go on with the learning rate perturbed. Its result is a learning-rate *schedule*. Both run
# as a driver inside the Ray job, the trials spread over its nodes:
#
#     sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_tune_gpt2.py --scheduler asha
#     sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_tune_gpt2.py --scheduler pbt
#
# and each writes `best.json` with the best validation loss and the steps its trials trained:
# set lesson 07's `--trials` and `--max-steps` alike to compare them on the same budget.

# %% [markdown]
# ## The documents and the questions
#
# The corpus is the course itself (the glossary, the book's pages, the lessons' text) and the
# reference of 23 modules of Python's standard library, read from their source: each function's
# signature and docstring. A site would put its own documentation here (its user guide, its
# FAQ, its module list).
#
# To measure retrieval, questions need known answers. The kit makes 200 from the documents
# themselves: "What is ...?" for glossary terms, answered by the first sentence of the
# definition, and "What does ... do?" for functions, answered by their docstring's summary line.
# Each question knows its answer's place in its document, so a retrieved passage can be checked
# without a person or a model judging it.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: your site's documentation as the corpus (its user guide, its FAQ); a
# question set with known answers as the first thing to build, before any tuning.
# :::

# %%
for question in QUESTIONS[:2] + QUESTIONS[100:102]:
    print(f"{question.text}\n    -> {question.answer}   ({question.document})")

# %% [markdown]
# ## Chunks
#
# A document is cut into **chunks** before it is indexed: windows of a fixed number of tokens
# (GPT-2's tokenizer, the one every model of the kit reads), each overlapping the next by a
# quarter so that no sentence is only ever cut in two, each headed by its document's title.
# Small chunks are precise (a retrieved chunk is mostly answer) but lose their context; large
# ones keep it but fill a model's context window with text that is not the answer. A chunk is
# *relevant* to a question when the answer starts inside it.

# %%
SIZES = [32, 64, 128, 256]
CHUNKS = {size: rag.chunk(CORPUS, size) for size in SIZES}
print(", ".join(f"{size} tokens: {len(chunks):,} chunks"
                for size, chunks in CHUNKS.items()))
print(CHUNKS[64][1000].text)

# %% [markdown]
# ## Two retrievers
#
# - **BM25** scores a chunk by the query's words it contains, weighting rare words more
#   (inverse document frequency) and long chunks less. It needs no model, and it is hard to beat
#   on names and exact terms.
# - A **dense retriever** maps each text to a vector (an **embedding**) so that a question and
#   the passage that answers it are close, and returns the chunks nearest the question's vector.
#   The vectors live in a **vector index**: FAISS here, exact inner products of unit vectors
#   (cosine similarity); at millions of chunks, an approximate index (IVF, HNSW) trades a little
#   recall for much speed.
#
# The embedder is any sentence-transformers model. On a cluster, a hub model such as
# `sentence-transformers/all-MiniLM-L6-v2` (downloaded on a login node) takes exactly this code
# path. Here, offline, it is the kit's own: a *static* embedding (one vector per token, averaged
# over the text), started from the token embeddings of the kit's pretrained GPT and trained
# contrastively on pairs of a question or title and its passage, from the documents *outside*
# the question set (`python -m coursekit rag embedder`). Its scores below are on documents it
# never saw.
#
# Embedding is the expensive part of indexing, and it parallelises perfectly: Ray Data streams
# the chunks to a pool of embedder replicas (actors, a GPU each on a cluster), as
# `solutions/ray_embed.py` does. `map_batches` with a class starts that many actors, builds the
# class once in each, and then calls it with batch after batch, whichever actor is free.
#
# **Exercise 1.** Write that class, the replica: `Embedder`. Ray Data builds it as
# `Embedder(name_or_path, device)` and calls it with batches, each a dictionary of numpy
# columns: `index`, the chunks' positions in the corpus, and `text`, their texts. A call returns
# a dictionary of two columns, the batch's `index` and `vector`, the texts' embeddings, row for
# row. `rag.embedder(name_or_path, device=device)` loads the model (seconds);
# `rag.embed(model, texts)` embeds a list of texts. Decide what happens once per actor and
# what once per batch. Batches come in any order and of any size.

# %% nbgrader={"grade": false, "grade_id": "embedder", "locked": false, "schema_version": 3, "solution": true, "task": false}
class Embedder:
    ### BEGIN SOLUTION
    def __init__(self, name_or_path, device):
        self.model = rag.embedder(name_or_path, device=device)  # once an actor: seconds

    def __call__(self, batch):
        return {"index": batch["index"],
                "vector": rag.embed(self.model, list(batch["text"]))}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "embedder_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
texts = [f"Job {i} asks Slurm for {i % 4 + 1} nodes of 4 GPUs each." for i in range(24)]
replica = Embedder(str(KIT_ROOT / "models" / "kit-embed"), "cpu")
answer = replica({"index": np.arange(3), "text": np.array(texts[:3])})
assert set(answer) == {"index", "vector"} and len(answer["vector"]) == 3
### BEGIN HIDDEN TESTS
from solutions import ray_embed  # noqa: E402  the kit's replica is not an answer

load, loads = rag.embedder, []


def counting_load(*args, **kwargs):
    loads.append(args)
    return load(*args, **kwargs)


rag.embedder = counting_load
try:
    with exercise.own_work(ray_embed.Embedder.__init__, ray_embed.Embedder.__call__):
        replica = Embedder(str(KIT_ROOT / "models" / "kit-embed"), "cpu")
        positions = [[17, 3, 9], [0], list(range(4, 24))[::-1]]  # any order and size
        answers = [replica({"index": np.array(p),
                            "text": np.array([texts[i] for i in p])})
                   for p in positions]
finally:
    rag.embedder = load
assert len(loads) <= 1, f"loaded {len(loads)} times: once an actor is enough"
alone = rag.embed(load(str(KIT_ROOT / "models" / "kit-embed")), texts)
for p, answer in zip(positions, answers):
    assert list(answer["index"]) == p
    assert np.allclose(np.asarray(answer["vector"]), alone[p], atol=1e-5)
### END HIDDEN TESTS

# %% [markdown]
# Your replicas, two of them, embed the corpus's 64-token chunks on this machine's local Ray,
# in the script's pipeline (`embed_with_ray_data`):

# %% tags=["demo"]
# the Ray Data script: its pipeline, here with your replica
from solutions import ray_embed  # noqa: E402

EMBEDDER = KIT_ROOT / "models" / "kit-embed"
if not (EMBEDDER / "modules.json").exists():  # made by `make`; here too, once
    subprocess.run(["make", "models/kit-embed/modules.json"], cwd=KIT_ROOT, check=True)

# its progress lines: the batch job's
logging.getLogger("ray.data").setLevel(logging.WARNING)
settings = ray_embed.parse_args(["--embedder", str(EMBEDDER), "--workers", "2"])
started = time.perf_counter()
vectors = ray_embed.embed_with_ray_data(CHUNKS[64], settings, replica=Embedder)
seconds = time.perf_counter() - started
model = rag.embedder(EMBEDDER)
alone = rag.embed(model, [c.text for c in CHUNKS[64]])
print(f"Ray Data: {len(vectors):,} chunks embedded by 2 replicas in {seconds:.1f} s, "
      f"{vectors.shape[1]} numbers each; "
      f"the largest difference from embedding them here, in "
      f"one process: {np.abs(vectors - alone).max():.1e}")
ray.shutdown()  # the lesson needs Ray no more: its processes go

# %% [markdown]
# ## Mean reciprocal rank
#
# A retriever returns a ranked list. For one question, the **reciprocal rank** is $1/r$, where $r$
# is the rank of the first relevant chunk (1 for the top), or 0 when none is among the first
# $k$ returned. The **mean reciprocal rank** (MRR) averages it over the questions: 1 means
# every answer came first; 0.5 when, say, every answer came second, or half came first and the
# others not at all (it averages $1/r$, not $r$). **Recall@k** is the share of questions with
# a relevant chunk in the first $k$: what a model that reads the top $k$ can find.
#
# The kit computes both from the rank of each question's first relevant chunk
# (`rag.mean_reciprocal_rank`, `rag.recall_at`).

# %% [markdown]
# Every retriever at every chunk size, the random baseline included (chunks in a random order),
# on the 200 questions:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Dense retrieval beats BM25.* Not on names and exact terms, and not with a small
#   embedder: in the lesson's table BM25 gives the best MRR of all (the cell checks it)
#   and is ahead at most chunk sizes; at the smallest the two come close, and either may
#   lead.
# - *The chunk size with the best MRR is the one to use.* Only if the model's context
#   holds as many chunks as the answer needs (exercise 2).
# :::

# %% tags=["demo"]
DEPTH = 10  # chunks each retriever returns
KS = [1, 3, 5, 10]
retrievers = {"BM25": rag.BM25, "dense": lambda chunks: rag.Dense(chunks, model),
              "random": rag.Random}
scores = {}
for size, chunks in CHUNKS.items():
    for name, make in retrievers.items():
        ranks = rag.first_relevant_ranks(make(chunks), chunks, QUESTIONS, DEPTH)
        scores[name, size] = {"mrr": rag.mean_reciprocal_rank(ranks),
                              "recall": {k: rag.recall_at(ranks, k) for k in KS}}
rows = [f"| {name} | {size} | {s['mrr']:.3f} | "
        + " | ".join(f"{s['recall'][k]:.2f}" for k in KS) + " |"
        for (name, size), s in scores.items()]
display(Markdown("| retriever | chunk tokens | MRR@10 | "
                 + " | ".join(f"recall@{k}" for k in KS)
                 + " |\n|---|---|---|" + "---|" * len(KS) + "\n" + "\n".join(rows)))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
for name in retrievers:
    axes[0].plot(SIZES, [scores[name, s]["mrr"] for s in SIZES], "o-", label=name)
    axes[1].plot(SIZES, [scores[name, s]["recall"][5] for s in SIZES], "o-", label=name)
for ax, what in zip(axes, ["MRR@10", "recall@5"]):
    ax.set(xscale="log", xticks=SIZES, xticklabels=SIZES, xlabel="chunk tokens",
           ylabel=what, ylim=(0, 1))
axes[0].legend()
plt.show()
best = max(scores, key=lambda key: scores[key]["mrr"])
baseline = scores["random", best[1]]["mrr"]
print(f"best: {best[0]} on chunks of {best[1]} tokens, MRR {scores[best]['mrr']:.3f} "
      f"and recall@5 {scores[best]['recall'][5]:.2f}; "
      f"random chunks of that size: MRR {baseline:.4f}, "
      f"a margin of {scores[best]['mrr'] - baseline:.3f}")
# on questions that name their terms, the small embedder is behind BM25 at its best
assert best[0] == "BM25", best

# %% [markdown]
# ## Choosing a chunk size
#
# The best MRR is not the whole answer: a model reads what fits in its context. The model that
# answers below has 128 positions, and the Alpaca prompt, the question and room for the answer
# take more than half of them; what is left, `PASSAGE_TOKENS`, holds the passages. With chunks
# of $s$ tokens the model reads the top $\lfloor P/s \rfloor$ of them (none, if one chunk is
# more than $P$): the chunk size that serves it best is the one whose recall at *that* depth is
# highest. A model with 8,000 positions would choose differently from the same table.
#
# **Exercise 2.** Write `best_chunk_size(recall, passage_tokens)`. `recall[size]` is a list whose
# element `k - 1` is the recall@k of chunks of `size` tokens, for k = 1, 2, ... up to its
# length. Return `(size, k)`: the chunk size whose recall at the number of its chunks that fit in
# `passage_tokens` is highest (that number capped at the list's length), and that number. On a
# tie, the smaller size. Return `None` if no chunk fits.

# %% nbgrader={"grade": false, "grade_id": "best_chunk_size", "locked": false, "schema_version": 3, "solution": true, "task": false}
def best_chunk_size(recall, passage_tokens):
    ### BEGIN SOLUTION
    options = []
    for size in sorted(recall):
        fits = min(passage_tokens // size, len(recall[size]))
        if fits >= 1:
            options.append((recall[size][fits - 1], -size, fits))
    if not options:
        return None
    _, negative_size, fits = max(options)
    return -negative_size, fits
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "best_chunk_size_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
table = {32: [0.3, 0.5, 0.6, 0.7], 64: [0.45, 0.6, 0.7, 0.75],
         128: [0.55, 0.7, 0.8, 0.85]}
# 0.5 for two of 32 tokens, 0.45 for one of 64
assert best_chunk_size(table, 64) == (32, 2)
assert best_chunk_size(table, 128) == (32, 4)
### BEGIN HIDDEN TESTS
assert best_chunk_size(table, 1000) == (128, 4)  # every list runs out: recall@4 each
assert best_chunk_size(table, 16) is None
assert best_chunk_size({64: [0.6], 32: [0.5, 0.6]}, 64) == (32, 2)  # a tie: the smaller
assert best_chunk_size({100: [0.2, 0.4, 0.9]}, 250) == (100, 2)
assert best_chunk_size(table, 127) == (32, 3)
### END HIDDEN TESTS

# %% [markdown]
# ## Answers, with and without retrieval
#
# The model that answers is lesson 05's: the kit's tiny GPT fine-tuned with the lora stage. It
# reads the Alpaca prompt it was trained on, with the question as the instruction and the
# retrieved chunks as the input. Its 128 positions hold the prompt and the answer, so the chunks
# get what the longest question's prompt and 24 answer tokens leave, titles included; the
# chunk size and depth are those of your `best_chunk_size` for BM25.
#
# Two scores, each against the reference answers: the **token F1** of the model's greedy answer
# (the harmonic mean of the precision and recall of its words: a SQuAD-style score, not SQuAD's
# own, whose official script also drops the articles *a*, *an* and *the* and deletes
# punctuation rather than splitting words at it), and the mean log-probability per token that
# the model gives the reference answer, a finer measure for a model that rarely writes the right
# words. For a bound, an *extractive* reader answers with the first sentence of the top chunk, as
# a reader that copies perfectly would.
#
# **Exercise 3.** Write `token_f1(prediction, reference)`, the SQuAD-style score of an answer.
# Take the words of each in lower case (`re.findall(r"\w+", text.lower())`), count the words
# they share (a word that occurs twice in both counts twice), and return the harmonic mean of the
# precision (shared words over the prediction's) and the recall (shared words over the
# reference's) as a float: 0.0 when they share none.

# %% nbgrader={"grade": false, "grade_id": "token_f1", "locked": false, "schema_version": 3, "solution": true, "task": false}
def token_f1(prediction, reference):
    ### BEGIN SOLUTION
    predicted = re.findall(r"\w+", prediction.lower())
    expected = re.findall(r"\w+", reference.lower())
    shared = sum((collections.Counter(predicted)
                  & collections.Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "token_f1_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
with exercise.own_work(rag.token_f1):
    assert token_f1("Return a list.", "return a list") == 1.0
    assert token_f1("dict", "Return a list.") == 0.0
    ### BEGIN HIDDEN TESTS
    # "the" twice in both
    assert abs(token_f1("the cat the", "the the dog") - 2 / 3) < 1e-12
    assert abs(token_f1("a b c d", "a b") - 2 * 0.5 * 1.0 / 1.5) < 1e-12
    assert isinstance(token_f1("x", "x"), float) and token_f1("", "anything") == 0.0
    assert token_f1("Serialize_obj, to JSON!", "serialize_obj to json") == 1.0
    ### END HIDDEN TESTS

# %% tags=["demo"]
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

LESSON_05_MODEL = (KIT_ROOT / "notebooks" / "05-llm-finetuning" / "runs" / "lora-single"
                   / "model")
# lesson 05 not run here: its fine-tuning, once
if not (LESSON_05_MODEL / "config.json").exists():
    result = subprocess.run([sys.executable,
                             KIT_ROOT / "solutions" / "finetune_lora.py",
                             "--preset", "tiny", "--model",
                             KIT_ROOT / "models" / "kit-tiny",
                             "--data", KIT_ROOT / "data" / "instruct", "--out",
                             RUNS / "lesson-05",
                             "--eval-interval", "125", "--eval-examples", "50"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    LESSON_05_MODEL = RUNS / "lesson-05" / "model"
reader = AutoModelForCausalLM.from_pretrained(LESSON_05_MODEL).eval()
tokenizer = AutoTokenizer.from_pretrained(LESSON_05_MODEL)
tokenizer.pad_token = tokenizer.eos_token
ANSWER_TOKENS = 24
PROMPT_TOKENS = reader.config.n_positions - ANSWER_TOKENS
bare = max(len(tokenizer(rag.prompt_for(q, [], tokenizer, PROMPT_TOKENS))["input_ids"])
           for q in QUESTIONS)
# the input's heading and a title's few tokens
PASSAGE_TOKENS = PROMPT_TOKENS - bare - 8
recall = {size: [rag.recall_at(rag.first_relevant_ranks(rag.BM25(chunks), chunks,
                                                          QUESTIONS, DEPTH), k)
                 for k in range(1, DEPTH + 1)]
          for size, chunks in CHUNKS.items()}
SIZE, K = best_chunk_size(recall, PASSAGE_TOKENS)
print(f"{reader.config.n_positions} positions: {PASSAGE_TOKENS} tokens for passages, "
      f"which "
      f"recall best as {K} chunk(s) of {SIZE} tokens "
      f"(recall@{K} {recall[SIZE][K - 1]:.2f})")

# %% tags=["demo"]
retrieved = rag.BM25(CHUNKS[SIZE]).search([q.text for q in QUESTIONS], K)
contexts = {"no retrieval": [[] for _ in QUESTIONS],
            f"BM25, {K} x {SIZE} tokens": [[CHUNKS[SIZE][i].text for i in found]
                                           for found in retrieved]}
rows, extractive = [], {}
for name, passages in contexts.items():
    prompts = [rag.prompt_for(q, p, tokenizer, PROMPT_TOKENS)
               for q, p in zip(QUESTIONS, passages)]
    answers = rag.generate(reader, tokenizer, prompts, ANSWER_TOKENS)
    f1 = np.mean([token_f1(a, q.answer) for a, q in zip(answers, QUESTIONS)])
    likelihood = np.mean([rag.answer_log_likelihood(
        reader, tokenizer, rag.prompt_for(q, p, tokenizer, reader.config.n_positions
                                          - len(tokenizer(q.answer)["input_ids"]) - 1),
        q.answer)
        for q, p in zip(QUESTIONS, passages)])
    extracted = np.mean([token_f1(rag.extracted_answer(p[0]), q.answer) if p else 0.0
                         for q, p in zip(QUESTIONS, passages)])
    extractive[name] = extracted
    rows.append(f"| {name} | {f1:.3f} | {likelihood:.2f} | {extracted:.3f} | "
                f"{answers[0]!r} |")
display(Markdown("| prompt | token F1 | log-probability of the reference, per token | "
                 "extractive F1 | first answer |\n|---|---|---|---|---|\n"
                 + "\n".join(rows)))
print(f"question: {QUESTIONS[0].text}  reference: {QUESTIONS[0].answer}")
copied = extractive[f"BM25, {K} x {SIZE} tokens"]
assert copied > 0.2, copied  # the answers are in the passages, for a reader that copies

# %% [markdown]
# With room for only a couple of short chunks, retrieval puts a relevant one in the prompt for
# the share of questions the recall above gives, and the extractive reader shows how much of the
# answers a model could take from the passages (the cell checks that it is a fair share). Lesson
# 05's model takes almost none of it: it was fine-tuned to answer in one word, it is 64 numbers
# wide and was pretrained for minutes, and copying a sentence from its prompt is beyond it.
# Compare the log-probability of the reference with and without the passages: for a model this
# small it barely moves, and may even fall (it did, a little, in the kit's runs), since it was
# never trained to read an answer from its prompt. That gap is the model's, and it closes
# with a real one: on a cluster, an instruction-tuned model from the hub such as
# `Qwen/Qwen2.5-7B-Instruct`, served by **vLLM** on the job's GPUs (`vllm serve <model>
# --host 127.0.0.1`, reached through the job's own loopback, or in the driver with
# `vllm.LLM(model)`), reads the same prompts through the same code, with room for many chunks in
# its context of thousands of tokens. Choose its chunk size again, from the same table, with
# its context.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Retrieval makes a model answer correctly.* It puts the answer in the prompt; the
#   tiny model of lesson 05 still does not write it, while the extractive bound shows it
#   was there.
# - Say here: where the embedder and the generator run (a GPU each, or a vLLM server
#   inside the job).
# :::

# %% [markdown]
# ## Key points
#
# - Ray runs functions (tasks) and stateful classes (actors) on a cluster of its own processes;
#   inside Slurm, the head runs on the job's first node and a worker on each other, and the job
#   stops them all.
# - On a shared cluster, a Ray cluster must demand a token (`RAY_AUTH_MODE=token`), from a file
#   only you can read, made anew for each job; reach its dashboard through an SSH tunnel.
# - Ray Data's `map_batches` with a class streams data through a pool of model replicas, each
#   loading the model once: the shape of batch inference and of embedding a corpus.
# - Ray Train wraps the DDP loop you know; Ray Tune adds schedulers (ASHA, PBT) to the search of
#   lesson 07, over the same space and budget.
# - A retrieval system cuts documents into token chunks, indexes them (BM25 for words, a dense
#   embedder and a vector index for meaning), and returns the top $k$ for a question.
# - Measure retrieval before generation: MRR and recall@k on questions with known answers,
#   against a random baseline. Choose the chunk size for the model's context, not for the
#   best MRR alone.
# - Retrieval puts the answer in the prompt; whether the answer comes out is the model's doing.
