# The course kit's commands. Every target sets itself up on a fresh machine: it creates .venv,
# installs requirements*.txt and the coursekit package, and fetches the GPT-2 tokenizer files.
#   make book        execute the lessons and build the HTML book (the main job)
#   make book-instructor   the same book with the exercises' solutions and hidden tests
#   make test        the whole test suite          make test-fast   unit + diff tests (< 2 min)
#   make setup-site  on a cluster: the environment on top of the site's PyTorch (load it first)
#   make lab         JupyterLab with the course kernel on 127.0.0.1
#   make assignments nbgrader student versions of every lesson into release/
#   make trainee-kit what trainees clone: the kit with student versions, no answers
#   make clean       remove everything the targets made
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
CORE := $(VENV)/.core
# After `make setup-site`, the site's torch as a pip constraint (torch==<its version>): every
# install keeps it, and none installs the pinned one
SITE_TORCH := $(wildcard $(VENV)/.site-torch)
REQUIREMENTS := $(if $(SITE_TORCH),<(grep -v '^torch==' requirements.txt) -c $(SITE_TORCH),requirements.txt)
CORE_PACKAGES := $(if $(SITE_TORCH),,torch) numpy tiktoken tqdm safetensors
# pip itself, pinned like everything else it installs
PIP := pip==26.3
# pip compiles no bytecode ahead (--no-compile): a process compiles what it imports, once, and
# Python keeps it for the next. The suite imports about 8,000 of the 28,000 modules installed,
# and the two installs took 101 CPU-s with bytecode, 28 without (2026-12-06). So Python must be
# let write it: a PYTHONDONTWRITEBYTECODE in the caller's environment (a CI image's) would have
# every process compile torch again, 3.7 CPU-s each.
PIP_INSTALL := -m pip install --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE
# tiktoken reads the GPT-2 vocabulary from here, so nothing is downloaded at run time.
export TIKTOKEN_CACHE_DIR := $(CURDIR)/.cache/tiktoken
# DeepSpeed compiles a C++ op on first use (lessons 05, the lora stage and its jobs): once per
# checkout, here, instead of once in each tool's default cache.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
DEEPSPEED_OP := $(TORCH_EXTENSIONS_DIR)/.complete
# Recipes, and all they start, find the venv's tools first, as the jobs do (they source
# .venv/bin/activate): the pinned ninja, whose records of DeepSpeed's build differ from the
# system ninja's, which rebuilt the op (a minute of both cores) after each use of the other.
export PATH := $(CURDIR)/$(BIN):$(PATH)
TOKENIZER := $(TIKTOKEN_CACHE_DIR)/.complete
BUILTIN_DATA := data/builtin/meta.json
INSTRUCT_DATA := data/instruct/meta.json
SHAPES_DATA := data/shapes/meta.json
BASE_RUN := runs/base-tiny/.complete
BASE_MODEL := models/kit-tiny/config.json
EMBED_MODEL := models/kit-embed/modules.json
# The book's widgets run on the ipywidgets HTML manager and RequireJS, and its formulas on MathJax,
# all served from the site itself (not a CDN) so that the book works offline; npm fetches them.
BOOK_JS_DIR := book/static
BOOK_JS := $(BOOK_JS_DIR)/.complete
HTML_MANAGER := @jupyter-widgets/html-manager@1.0.15
REQUIREJS := requirejs@2.3.8
MATHJAX := mathjax@3.2.2
# Each tarball's sha512, as the npm registry publishes it (`npm view <package> dist.integrity`):
# a tarball changed on its way here (registry, mirror, proxy) stops the build.
NPM_SHA512 := book/npm-packages.sha512
NPM_PACK := npm pack --silent

# Two jobs at once: the set-up's steps that do not depend on each other run side by side.
MAKEFLAGS += --jobs=2

.PHONY: setup setup-site course-files book book-instructor test test-fast lab assignments trainee-kit \
  clean

setup: $(INSTALLED) $(TOKENIZER)

# The course environment on a cluster, on top of the site's PyTorch (its CUDA or ROCm build: load
# its module, or activate its conda env, first; PYTHON is the python3 that has it): a venv that
# sees the site's packages, and `make setup` in it, which then installs everything else at the
# pinned versions and keeps the site's torch (SITE_TORCH): pip keeps it or stops, never replaces
# it. Last, a check that the venv's torch is the site's, and what it sees.
setup-site:
	@test ! -e $(VENV) || { echo "error: $(VENV) exists: remove it (rm -rf $(VENV)) to build it on the site's PyTorch" >&2; exit 2; }
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "error: $$(command -v $(PYTHON)) has no torch: load the site's PyTorch module (or activate its conda env) first, or give PYTHON=<its python>" >&2; exit 2; }
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
	  > $(VENV)/.site-torch || { rm -rf $(VENV); echo "error: the site's torch has no package metadata, so pip would install another over it: ask your centre for a PyTorch installed with pip or conda" >&2; exit 2; }
	$(MAKE) setup
	$(BIN)/python -m coursekit site-torch

# Two steps, so that the base model (below) trains on one core while pip, which uses one, installs
# the rest: first what the corpus and the std stage import, at the versions requirements.txt pins
# (as constraints, which cannot name extras such as ray[default]: the same pins without them).
$(CORE): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) $(PIP)
	$(BIN)/python $(PIP_INSTALL) -c <(sed -E 's/\[[^]]*\]//' requirements.txt) $(CORE_PACKAGES)
	$(BIN)/python $(PIP_INSTALL) --no-deps -e .
	touch $@

$(INSTALLED): $(CORE) requirements-dev.txt
	$(BIN)/python $(PIP_INSTALL) -r $(REQUIREMENTS) -r requirements-dev.txt -e .
	touch $@

$(TOKENIZER): $(CORE)
	$(BIN)/python -m coursekit tokenizer fetch
	touch $@

# widgets/: embed-amd.js with the icon fonts it loads from beside itself, and require.js;
# mathjax/: MathJax's CommonHTML bundle with the fonts and TeX extensions it loads on demand (its
# speech-rule engine and other bundles left out). Each package.json names the version and licence.
$(BOOK_JS): $(NPM_SHA512)
	rm -rf .cache/npm $(BOOK_JS_DIR) && mkdir -p .cache/npm $(BOOK_JS_DIR)/widgets $(BOOK_JS_DIR)/mathjax
	cd .cache/npm && $(NPM_PACK) $(HTML_MANAGER) $(REQUIREJS) $(MATHJAX) >/dev/null
	cd .cache/npm && sha512sum --check --strict $(CURDIR)/$(NPM_SHA512)
	cd .cache/npm && for package in *.tgz; do mkdir -p "$${package%.tgz}" && \
	  tar -xzf "$$package" -C "$${package%.tgz}"; done
	cd .cache/npm/jupyter-widgets-html-manager-*/package && \
	  cp dist/embed-amd.js dist/*.{woff,woff2,eot,ttf,svg} $(CURDIR)/$(BOOK_JS_DIR)/widgets/ && \
	  cp package.json $(CURDIR)/$(BOOK_JS_DIR)/widgets/html-manager.package.json
	cd .cache/npm/requirejs-*/package && cp require.js $(CURDIR)/$(BOOK_JS_DIR)/widgets/ && \
	  cp package.json $(CURDIR)/$(BOOK_JS_DIR)/widgets/requirejs.package.json
	cd .cache/npm/mathjax-*/package && cp package.json $(CURDIR)/$(BOOK_JS_DIR)/mathjax/ && \
	  cd es5 && cp -r tex-mml-chtml.js a11y adaptors input output ui $(CURDIR)/$(BOOK_JS_DIR)/mathjax/
	rm -rf .cache/npm
	touch $@

$(BUILTIN_DATA): $(CORE) $(TOKENIZER)
	$(BIN)/python -m coursekit data prepare --source builtin --out data/builtin

$(INSTRUCT_DATA): $(INSTALLED)
	$(BIN)/python -m coursekit instruct prepare --out data/instruct

# Lesson 08's images, the kit's shapes: drawn in seconds, the same bytes everywhere (so drawn again
# from scratch after a new install: the command writes into an empty folder only).
$(SHAPES_DATA): $(INSTALLED)
	rm -rf data/shapes
	$(BIN)/python -m coursekit images prepare --out data/shapes --files

# The pretrained model lesson 05 fine-tunes: the std stage's tiny run, in Hugging Face format.
# The corpus is needed first, but preparing it again (the Slurm tests' data job does, with the
# same content) must not train and export the model again while lessons and tests read it:
# order-only. The export needs transformers, from the second install. Two threads, since the
# set-up waits for this run: in a fresh `make test` (2026-12-06), beside the second install, it
# took 104 s and 169 CPU-s, where one thread took 127 s and 125 CPU-s; alone, 0.24 s a step
# against 0.39.
$(BASE_RUN): $(CORE) | $(BUILTIN_DATA)
	OMP_NUM_THREADS=2 $(BIN)/python solutions/train_gpt2_std.py --preset tiny --data data/builtin --out runs/base-tiny \
	  --resume
	touch $@

# The tests' first ZeRO run would compile DeepSpeed's CPU communication op; the set-up does it
# instead, once the base model has trained, beside the export and the embedder: the base model's
# two threads need both cores (beside the build, its steps took 0.77 s instead of 0.41 even with
# one thread, in a fresh set-up, 2026-11-30). One compiler at a time (MAX_JOBS,
# torch.utils.cpp_extension's): ninja would otherwise compile the op's two files at once and
# take both cores from the embedder.
$(DEEPSPEED_OP): $(INSTALLED) | $(BASE_RUN)
	MAX_JOBS=1 $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
	  op = get_accelerator().create_op_builder('ShareMemCommBuilder'); \
	  op and op.is_compatible() and op.load()"
	touch $@

$(BASE_MODEL): $(BASE_RUN) $(INSTALLED)
	$(BIN)/python -m coursekit export-hf runs/base-tiny models/kit-tiny --force --untie

# Lesson 09's dense retriever: a static embedding started from the base model's token embeddings
# and trained on the course's documents (those of lesson 09's question set held out): again when
# they change.
$(EMBED_MODEL): $(BASE_MODEL) coursekit/rag.py $(wildcard book/*.md notebooks/*/[0-9]*.py)
	$(BIN)/python -m coursekit rag embedder --base models/kit-tiny --out models/kit-embed

# What the lessons read and no network is needed for: the corpus, lesson 05's tasks and base
# model, lesson 08's images, lesson 09's retriever. On a cluster, a compute node makes them
# (batchfiles/<site>/batch-course-files.sh): the base model is minutes of a few cores.
COURSE_FILES := $(BUILTIN_DATA) $(INSTRUCT_DATA) $(SHAPES_DATA) $(BASE_MODEL) $(EMBED_MODEL)
course-files: $(COURSE_FILES)

# Execute every lesson (cached in _build/.jupyter_cache: unchanged lessons are not re-run) and
# build the HTML book with warnings as errors. The reader's edition (published) shows exercises as
# students get them; the instructor's edition shows solutions and hidden tests (coursekit/book.py).
BOOK_INPUTS := setup $(BOOK_JS) $(COURSE_FILES)
book: $(BOOK_INPUTS)
	$(BIN)/python -m coursekit envcheck
	$(BIN)/python -m coursekit book --edition reader

book-instructor: $(BOOK_INPUTS)
	$(BIN)/python -m coursekit book --edition instructor

# `make test PYTEST_ARGS=--random-order-seed=N`: the tests of each file in a random order.
# pytest-xdist workers of one thread each (tests/conftest.py: the longest files first, the
# lessons and the book on one worker; the book is built from nbval's executions of the lessons,
# so that each lesson executes once for both). Two share every other test on the 2 cores; a
# third runs the Slurm tests alone, which mostly wait for jobs (Slurm's processes, not the
# worker's) and left a core idle while they waited. Three workers that all took any test kept
# the load at 6 to 12, and services that must start within a time limit (Ray's raylet, an MLflow
# server) missed it.
test: setup $(BOOK_JS) $(INSTRUCT_DATA) $(SHAPES_DATA) $(BASE_MODEL) $(EMBED_MODEL) $(DEEPSPEED_OP)
	$(BIN)/python -m pytest -n 3 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "(unit or diffs) and not slow"

# On 127.0.0.1, kernels over Unix sockets only you can reach, torch.compile's caches your own
# (coursekit/launch.py: lab_command; coursekit/caches.py)
lab: setup
	$(BIN)/python -m coursekit lab

# Student versions: solutions and hidden tests removed. When grading, autograde skips the cells
# tagged "demo" (runs and launches no exercise needs; nbgrader_config.py, book/instructor.md).
assignments: setup
	$(BIN)/python -m coursekit assignments

# The kit as trainees get it, in trainee-kit/: student versions of the lessons and everything they
# need to run; no solution, hidden test or grading test (coursekit/trainee.py). Publish that folder
# (a repository of its own) for trainees to clone, not this checkout.
trainee-kit: setup
	rm -rf trainee-kit
	$(BIN)/python -m coursekit trainee-kit --out trainee-kit

clean:
	rm -rf $(VENV) .cache data models runs release trainee-kit submitted autograded feedback \
	  gradebook.db _build $(BOOK_JS_DIR) \
	  .pytest_cache notebooks/*/runs notebooks/*/train_gpt2.py
