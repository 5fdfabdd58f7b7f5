"""Retrieval-augmented generation over the course's own documents (lesson 09).

The documents are the course's (the glossary, the book's pages, the lessons' text) and the
reference of a fixed set of standard-library modules, read from their source as the builtin
corpus is (each function's or method's signature and docstring). All of it is on every machine
the kit runs on, so the question set is made from it deterministically, with no model and no
download:

    python    "What does json.dumps do?"        the docstring's summary line, under its signature
    glossary  "What is a loader worker?"        the first sentence of the glossary's definition

Each question knows the passage that answers it (a span of one document's text): a retrieved
chunk is relevant when that span starts inside it. Chunks are windows of tokens (GPT-2's
tokenizer, as every model of the kit reads), each headed by its document's title, as search
systems index pages. Two retrievers rank them: BM25 over words, and the cosine similarity of dense
embeddings held in a FAISS index. The embedder is any sentence-transformers model: a hub name on a
cluster (downloaded on a login node), or here the kit's own pretrained GPT (models/kit-tiny), whose
hidden states sentence-transformers averages into one vector, as it does for any plain Hugging Face
model.
"""
import ast
import dataclasses
import importlib.util
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coursekit import KIT_ROOT, KitError, data

#: Standard-library modules whose reference is in the corpus: pure Python, documented in their
#: source, and ones the course's scripts use.
PYTHON_MODULES = ("argparse", "bisect", "contextlib", "csv", "dataclasses", "fractions",
                  "functools", "glob", "heapq", "json", "logging", "pathlib", "queue", "random",
                  "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile",
                  "textwrap", "threading", "zipfile")
BOOK_PAGES = ("intro.md", "setup.md", "cluster.md", "lesson-notes.md")
QUESTIONS_PER_SOURCE = 100
SEED = 909
MIN_ANSWER_WORDS = 4


@dataclass(frozen=True)
class Document:
    id: str      # "python/json.dumps", "glossary/LARS", "book/cluster.md#3", "lesson/08-vision#5"
    title: str   # what a reader sees above the text: a signature, a term, a page and heading
    text: str


@dataclass(frozen=True)
class Question:
    text: str
    answer: str      # the reference answer, a span of the document's text
    document: str    # Document.id
    start: int       # where the answer starts in the document's text


@dataclass(frozen=True)
class Chunk:
    document: str
    title: str
    start: int       # the characters of the document's text the chunk holds
    end: int
    body: str

    @property
    def text(self):
        """What is indexed, embedded and put in a prompt: the title, then the body."""
        return f"{self.title}\n{self.body}"


# ---------------------------------------------------------------------------------------------
# The documents
# ---------------------------------------------------------------------------------------------
def documents(kit_root=KIT_ROOT):
    """Every document of the corpus, in a fixed order."""
    return [*glossary_documents(kit_root), *book_documents(kit_root), *lesson_documents(kit_root),
            *python_documents()]


def glossary_documents(kit_root=KIT_ROOT):
    """One document per glossary entry: its terms (a term and its other spellings), then the
    definition as one paragraph."""
    text = (Path(kit_root) / "book" / "glossary.md").read_text()
    block = text.split("```{glossary}\n", 1)[1].split("\n```", 1)[0]
    entries = []
    for paragraph in re.split(r"\n\s*\n", block):
        lines = paragraph.strip("\n").splitlines()
        terms = [line for line in lines if not line.startswith(" ")]
        definition = " ".join(line.strip() for line in lines if line.startswith(" "))
        entries.append(Document(f"glossary/{terms[0]}", f"Glossary: {' / '.join(terms)}",
                                definition))
    return entries


def sections(page_title, markdown, id_prefix):
    """A page of Markdown as one document per section (a heading and the text up to the next)."""
    parts = re.split(r"^(#{1,4} .*)$", markdown, flags=re.MULTILINE)
    found, heading = [], None
    for part in parts:
        if re.match(r"#{1,4} ", part):
            heading = part.lstrip("#").strip()
        elif part.strip():
            own_heading = heading and heading != page_title
            title = f"{page_title} › {heading}" if own_heading else page_title
            found.append(Document(f"{id_prefix}#{len(found)}", title, part.strip()))
    return found


def book_documents(kit_root=KIT_ROOT):
    pages = []
    for name in BOOK_PAGES:
        markdown = (Path(kit_root) / "book" / name).read_text()
        page_title = re.search(r"^# (.*)$", markdown, re.MULTILINE).group(1)
        pages.extend(sections(page_title, markdown, f"book/{name}"))
    return pages


def markdown_cells(percent_script):
    """The Markdown cells of a jupytext py:percent script, comment marks removed."""
    cells = re.split(r"^# %%.*$", percent_script, flags=re.MULTILINE)
    headers = re.findall(r"^# %%.*$", percent_script, flags=re.MULTILINE)
    return ["\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                      for line in cell.strip("\n").splitlines())
            for header, cell in zip(headers, cells[1:]) if "[markdown]" in header]


def lesson_documents(kit_root=KIT_ROOT):
    """The lessons' text (their Markdown cells; no code, so no exercise's solution)."""
    lessons = []
    for folder in sorted((Path(kit_root) / "notebooks").iterdir()):
        script = folder / f"{folder.name}.py"
        if script.is_file():
            markdown = "\n\n".join(markdown_cells(script.read_text()))
            title = re.search(r"^# (.*)$", markdown, re.MULTILINE).group(1)
            lessons.extend(sections(title, markdown, f"lesson/{folder.name}"))
    return lessons


def python_documents(modules=PYTHON_MODULES):
    """One document per public function and method of the modules: its signature, as the title,
    and its docstring."""
    found = []
    for module in modules:
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_bytes())
        for qualname, node in public_functions(tree):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= data.MIN_DOCSTRING_CHARS:
                signature = f"{module}.{qualname}({ast.unparse(node.args)})"
                found.append(Document(f"python/{module}.{qualname}", signature, doc))
    return found


def public_functions(tree):
    """(qualified name, node) of the module's public functions and of its public classes' public
    methods, in source order."""
    def public(name):
        return not name.startswith("_")

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and public(node.name):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and public(node.name):
            for method in node.body:
                if isinstance(method, functions) and public(method.name):
                    yield f"{node.name}.{method.name}", method


# ---------------------------------------------------------------------------------------------
# The questions
# ---------------------------------------------------------------------------------------------
def first_sentence(text):
    """The text up to its first full stop followed by a space or the end, or its first paragraph."""
    paragraph = text.strip().split("\n\n", 1)[0]
    match = re.search(r"[.!?](\s|$)", paragraph)
    sentence = paragraph[:match.end()] if match else paragraph
    return sentence.strip()


def question_for(document):
    """The question a document answers, or None where its first sentence is too short to be an
    answer (a docstring such as "Deprecated.")."""
    answer = first_sentence(document.text)
    if len(answer.split()) < MIN_ANSWER_WORDS:
        return None
    source, name = document.id.split("/", 1)
    text = f"What does {name} do?" if source == "python" else f"What is {name}?"
    return Question(text, answer, document.id, document.text.index(answer))


def questions(corpus, per_source=QUESTIONS_PER_SOURCE, seed=SEED):
    """The question set: ``per_source`` questions drawn with a fixed seed from the glossary's
    entries and as many from the Python reference's (fewer where there are fewer)."""
    rng = random.Random(seed)
    drawn = []
    for source in ("glossary", "python"):
        candidates = [q for d in corpus if d.id.startswith(f"{source}/")
                      if (q := question_for(d)) is not None]
        drawn.extend(rng.sample(candidates, min(per_source, len(candidates))))
    return drawn


# ---------------------------------------------------------------------------------------------
# Chunks
# ---------------------------------------------------------------------------------------------
def chunk(corpus, size, overlap=None, encoding=None):
    """Every document cut into windows of ``size`` tokens, each starting ``size - overlap``
    tokens after the one before (``overlap`` a quarter of ``size`` unless given), so that a
    sentence cut by one window's end is whole in the next."""
    overlap = size // 4 if overlap is None else overlap
    if not 0 <= overlap < size:
        raise KitError(f"chunk overlap {overlap}: it must be at least 0 and less than the chunk "
                       f"size {size}")
    encoding = encoding or data.gpt2_encoding()
    chunks = []
    for document in corpus:
        tokens = encoding.encode_ordinary(document.text)
        _, offsets = encoding.decode_with_offsets(tokens)
        offsets.append(len(document.text))
        for first in range(0, max(len(tokens) - overlap, 1), size - overlap):
            start, end = offsets[first], offsets[min(first + size, len(tokens))]
            chunks.append(Chunk(document.id, document.title, start, end,
                                document.text[start:end]))
    return chunks


def is_relevant(chunk_, question):
    """Whether the chunk holds the start of the question's answer."""
    return chunk_.document == question.document and chunk_.start <= question.start < chunk_.end


# ---------------------------------------------------------------------------------------------
# Retrievers: each ranks the chunks for a list of queries, best first
# ---------------------------------------------------------------------------------------------
class BM25:
    """Okapi BM25 over words (bm25s: lower case, English stop words removed)."""

    def __init__(self, chunks):
        import bm25s

        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([c.text for c in chunks], stopwords="en",
                                        show_progress=False), show_progress=False)

    def search(self, queries, k):
        import bm25s

        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False)
        found, _ = self.index.retrieve(tokens, k=k, show_progress=False)
        return found.tolist()


def embedder(name_or_path, device="cpu"):
    """A sentence-transformers model: a hub name (all-MiniLM-L6-v2, ...) or a local directory;
    a plain Hugging Face model, such as the kit's exported GPT, gets mean pooling."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(name_or_path), device=device)


def embed(model, texts, batch_size=64):
    """Unit-length float32 vectors, one row per text: their dot products are cosine similarities."""
    vectors = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                           convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


class Dense:
    """Nearest chunks by cosine similarity, in an exact FAISS index (inner product of unit
    vectors). ``vectors``: the chunks' embeddings, when they were computed elsewhere (Ray Data)."""

    def __init__(self, chunks, model, vectors=None):
        import faiss

        self.model = model
        vectors = embed(model, [c.text for c in chunks]) if vectors is None else vectors
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def search(self, queries, k):
        _, found = self.index.search(embed(self.model, queries), k)
        return found.tolist()


class Random:
    """The baseline: chunks in a random order, another for each query."""

    def __init__(self, chunks, seed=SEED):
        self.count, self.rng = len(chunks), np.random.default_rng(seed)

    def search(self, queries, k):
        return [self.rng.permutation(self.count)[:k].tolist() for _ in queries]


def save_embeddings(run_dir, chunks, vectors):
    """chunks.jsonl and vectors.npy (row i: chunk i), each written to a temporary file, then
    renamed."""
    lines = "".join(json.dumps(dataclasses.asdict(c)) + "\n" for c in chunks)
    files = {"chunks.jsonl": lambda f: f.write(lines.encode()),
             "vectors.npy": lambda f: np.save(f, vectors)}
    for name, write in files.items():
        tmp = Path(run_dir) / f".{name}.tmp"
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, Path(run_dir) / name)


def load_embeddings(run_dir):
    """(chunks, vectors) as save_embeddings wrote them."""
    lines = (Path(run_dir) / "chunks.jsonl").read_text().splitlines()
    return ([Chunk(**json.loads(line)) for line in lines],
            np.load(Path(run_dir) / "vectors.npy", allow_pickle=False))


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------
def first_relevant_ranks(retriever, chunks, question_set, depth):
    """For each question, the rank (1 = first) of the first relevant chunk among the retriever's
    top ``depth``, or None where none of them is."""
    ranked = retriever.search([q.text for q in question_set], depth)
    return [next((rank for rank, index in enumerate(found, 1)
                  if is_relevant(chunks[index], question)), None)
            for question, found in zip(question_set, ranked)]


def mean_reciprocal_rank(ranks):
    """The mean over questions of 1/rank of the first relevant chunk (0 where none was found)."""
    return sum(1 / rank for rank in ranks if rank) / len(ranks)


def recall_at(ranks, k):
    """The share of questions with a relevant chunk in the top k."""
    return sum(1 for rank in ranks if rank and rank <= k) / len(ranks)


# ---------------------------------------------------------------------------------------------
# The kit's own embedder
# ---------------------------------------------------------------------------------------------
EMBEDDER_CHUNK_TOKENS = 64


def answered_questions(corpus, held_out, chunk_tokens=EMBEDDER_CHUNK_TOKENS):
    """(question, the chunk that answers it) for each document outside ``held_out`` that makes a
    question, and the chunks of those documents."""
    chunks = [c for c in chunk(corpus, chunk_tokens) if c.document not in held_out]
    pairs = []
    for document in corpus:
        question = None if document.id in held_out else question_for(document)
        if question:
            pairs.append((question, next(c for c in chunks if is_relevant(c, question))))
    return pairs, chunks


def training_pairs(corpus, held_out, chunk_tokens=EMBEDDER_CHUNK_TOKENS):
    """(anchor, positive) texts from the documents outside ``held_out``: each document's question
    with the chunk that answers it, and each chunk's title with the chunk (a page's heading finds
    its text). The question set's documents are held out, so that its scores measure documents the
    embedder never saw."""
    answered, chunks = answered_questions(corpus, held_out, chunk_tokens)
    return [(q.text, c.text) for q, c in answered] + [(c.title, c.text) for c in chunks]


def reading_examples(corpus, held_out, chunk_tokens=EMBEDDER_CHUNK_TOKENS):
    """Instruction-tuning records (the Alpaca schema of coursekit.instruct) that teach a model to
    answer from a passage: a question of a document outside ``held_out``, the chunk that answers
    it as the input, and its answer as the output."""
    answered, _ = answered_questions(corpus, held_out, chunk_tokens)
    return [{"instruction": q.text, "input": c.text, "output": q.answer,
             "task": q.document.split("/")[0]} for q, c in answered]


def train_embedder(base_model, out, corpus, held_out, epochs=10, seed=SEED):
    """Train the kit's dense embedder and save it to ``out`` as a sentence-transformers model:
    a static embedding (a vector per GPT-2 token, averaged over the text, as model2vec and
    sentence-transformers' static models do), started from the token embeddings of the kit's
    pretrained GPT and trained with in-batch negatives (MultipleNegativesRankingLoss): each
    anchor is pulled towards its own positive and pushed from the other anchors' ones. A static
    model embeds thousands of chunks a second on a CPU; a transformer embedder is more accurate
    and takes the same code path (``embedder``)."""
    from datasets import Dataset
    from safetensors.numpy import load_file
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from sentence_transformers.models import StaticEmbedding
    from tokenizers import Tokenizer

    base_model = Path(base_model)
    tokenizer = Tokenizer.from_file(str(base_model / "tokenizer.json"))
    token_vectors = load_file(base_model / "model.safetensors")["transformer.wte.weight"]
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, token_vectors)], device="cpu")
    anchors, positives = zip(*training_pairs(corpus, held_out))
    with tempfile.TemporaryDirectory() as scratch:  # the trainer's own files: none are kept
        settings = SentenceTransformerTrainingArguments(
            output_dir=scratch, num_train_epochs=epochs, per_device_train_batch_size=64,
            learning_rate=0.05, seed=seed, use_cpu=True, save_strategy="no", report_to="none",
            disable_tqdm=True, log_level="error")
        SentenceTransformerTrainer(
            model=model, args=settings, loss=MultipleNegativesRankingLoss(model),
            train_dataset=Dataset.from_dict({"anchor": anchors, "positive": positives})).train()
    model.save(str(out), create_model_card=False)
    return model


# ---------------------------------------------------------------------------------------------
# Generation: the fine-tuned model answers, with and without the retrieved passages
# ---------------------------------------------------------------------------------------------
def prompt_for(question, passages, tokenizer, budget):
    """The Alpaca prompt of the lora stage with the question as its instruction and the passages
    as its input, the passages cut so that the prompt is at most ``budget`` tokens."""
    from coursekit.instruct import format_prompt

    bare = format_prompt({"instruction": question.text, "input": "…"})
    room = budget - len(tokenizer(bare)["input_ids"])
    context = tokenizer("\n\n".join(passages), verbose=False)["input_ids"][:max(room, 0)]
    return format_prompt({"instruction": question.text, "input": tokenizer.decode(context)})


def answer_log_likelihood(model, tokenizer, prompt, answer):
    """The mean log-probability per token of ``answer`` (and the end of text) after ``prompt``."""
    import torch

    prompt_ids = tokenizer(prompt)["input_ids"]
    answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    chosen = logits.log_softmax(-1).gather(1, torch.tensor(answer_ids)[:, None])
    return chosen.mean().item()


def generate(model, tokenizer, prompts, max_new_tokens, batch_size=16):
    """The model's greedy answer to each prompt, a batch at a time (padded on the left, so that
    every prompt ends where its answer begins)."""
    import torch

    answers = []
    for first in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[first:first + batch_size], return_tensors="pt", padding=True,
                          padding_side="left")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        answers += [a.strip() for a in tokenizer.batch_decode(
            out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)]
    return answers


def extracted_answer(passage):
    """What a reader that copies perfectly would answer from a retrieved chunk: the first
    sentence of its body (below the title line). A bound on what a model can take from it."""
    return first_sentence(passage.split("\n", 1)[-1])


def words(text):
    return re.findall(r"\w+", text.lower())


def token_f1(prediction, reference):
    """SQuAD's answer score: the harmonic mean of the precision and recall of the prediction's
    words against the reference's (each word counted as often as it occurs in both)."""
    from collections import Counter

    common = sum((Counter(words(prediction)) & Counter(words(reference))).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(words(prediction)), common / len(words(reference))
    return 2 * precision * recall / (precision + recall)
