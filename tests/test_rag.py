"""Lesson 09's retrieval (coursekit/rag.py): the corpus and question set the kit makes from its own
documents, token chunks, BM25 and the dense retriever on the kit's embedder, and their scores
against a random baseline (the Ray Data script that embeds the chunks: tests/test_ray.py)."""
import re

import pytest

from coursekit import KIT_ROOT, KitError, data, rag

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def corpus():
    return rag.documents()


@pytest.fixture(scope="module")
def question_set(corpus):
    return rag.questions(corpus)


@pytest.fixture(scope="module")
def chunks(corpus):
    return rag.chunk(corpus, 64)


def test_the_corpus_holds_the_course_and_the_python_reference(corpus):
    sources = {d.id.split("/")[0] for d in corpus}
    assert sources == {"glossary", "book", "lesson", "python"}
    assert len({d.id for d in corpus}) == len(corpus)
    glossary = {d.id: d for d in corpus}["glossary/LARS"]
    assert glossary.title.startswith("Glossary: LARS") and "trust ratio" in glossary.text.lower()
    dumps = {d.id: d for d in corpus}["python/json.dumps"]
    assert dumps.title.startswith("json.dumps(obj") and "JSON" in dumps.text
    assert any(d.id.startswith("lesson/08-vision") for d in corpus)


def test_a_lesson_gives_its_text_and_no_code():
    script = ("# %% [markdown]\n# # Title\n#\n# Some *text*.\n\n"
              "# %% tags=[\"solution\"]\nanswer = 42\n\n# %% [markdown]\n# ## More\n")
    assert rag.markdown_cells(script) == ["# Title\n\nSome *text*.", "## More"]


def test_the_question_set_is_the_same_each_time_and_points_at_its_answers(corpus, question_set):
    assert question_set == rag.questions(rag.documents())
    by_id = {d.id: d for d in corpus}
    assert [q.document.split("/")[0] for q in question_set] == ["glossary"] * 100 + ["python"] * 100
    for question in question_set:
        text = by_id[question.document].text
        assert text[question.start:question.start + len(question.answer)] == question.answer
        assert len(question.answer.split()) >= rag.MIN_ANSWER_WORDS


def test_chunks_are_token_windows_that_cover_every_document(corpus):
    encoding = data.gpt2_encoding()
    for size in (32, 128):
        chunks = rag.chunk(corpus, size, encoding=encoding)
        for document in corpus[::25]:
            mine = [c for c in chunks if c.document == document.id]
            assert mine[0].start == 0 and mine[-1].end == len(document.text)
            for before, after in zip(mine, mine[1:]):
                assert after.start < before.end  # they overlap: no sentence is only ever cut
            assert all(len(encoding.encode_ordinary(c.body)) <= size + 1 for c in mine)
            assert all(c.text.startswith(document.title + "\n") for c in mine)


def test_a_chunk_overlap_outside_the_chunk_is_one_line(corpus):
    with pytest.raises(KitError, match=r"^chunk overlap 64: .* less than the chunk size 64$"):
        rag.chunk(corpus[:1], 64, overlap=64)


def test_a_chunk_is_relevant_where_the_answer_starts_in_it():
    question = rag.Question("q?", "the answer.", "python/m.f", 100)
    assert rag.is_relevant(rag.Chunk("python/m.f", "t", 90, 150, "x"), question)
    assert not rag.is_relevant(rag.Chunk("python/m.f", "t", 101, 150, "x"), question)
    assert not rag.is_relevant(rag.Chunk("python/m.g", "t", 90, 150, "x"), question)


def test_mrr_and_recall_from_the_ranks():
    ranks = [1, 2, None, 4]
    assert rag.mean_reciprocal_rank(ranks) == pytest.approx((1 + 1 / 2 + 0 + 1 / 4) / 4)
    assert [rag.recall_at(ranks, k) for k in (1, 2, 10)] == [0.25, 0.5, 0.75]


def test_token_f1_is_squads_word_overlap():
    assert rag.token_f1("Serialize obj to JSON.", "serialize obj to a JSON string") == \
        pytest.approx(2 * (4 / 4) * (4 / 6) / (4 / 4 + 4 / 6))
    assert rag.token_f1("dict", "Return a list.") == 0.0


def scores(retriever, chunks, question_set):
    ranks = rag.first_relevant_ranks(retriever, chunks, question_set, 10)
    return rag.mean_reciprocal_rank(ranks), rag.recall_at(ranks, 10)


def test_bm25_finds_the_answers_far_more_often_than_random_passages(chunks, question_set):
    bm25, random = scores(rag.BM25(chunks), chunks, question_set), \
        scores(rag.Random(chunks), chunks, question_set)
    assert bm25[0] > 0.4 and bm25[1] > 0.7
    assert random[0] < 0.02 and bm25[0] > 20 * random[0]


def test_the_kits_embedder_never_saw_the_question_sets_documents(corpus, question_set):
    held_out = {q.document for q in question_set}
    pairs = rag.training_pairs(corpus, held_out)
    assert len(pairs) > 1000
    outside = {c.text for c in rag.chunk(corpus, rag.EMBEDDER_CHUNK_TOKENS)
               if c.document not in held_out}
    assert all(positive in outside for _, positive in pairs)
    assert not {q.text for q in question_set} & {anchor for anchor, _ in pairs}


@pytest.mark.slow  # the embedder is trained first where `make` has not
def test_dense_retrieval_with_the_kits_embedder_beats_random_passages(kit_embedder, chunks,
                                                                       question_set):
    model = rag.embedder(kit_embedder)
    dense = scores(rag.Dense(chunks, model), chunks, question_set)
    random = scores(rag.Random(chunks), chunks, question_set)
    assert dense[0] > 10 * random[0] and dense[1] > 0.3


@pytest.mark.slow  # the base model is trained first where `make` has not
def test_a_prompt_fits_the_models_context(base_run, question_set, chunks):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(KIT_ROOT / "models" / "kit-tiny")
    question = question_set[0]
    prompt = rag.prompt_for(question, [c.text for c in chunks[:5]], tokenizer, budget=100)
    assert 90 <= len(tokenizer(prompt)["input_ids"]) <= 100
    assert question.text in prompt and prompt.endswith("### Response:\n")
    assert chunks[0].text[:40] in prompt
    assert re.search(r"### Input:\n", rag.prompt_for(question, [], tokenizer, 100)) is None


@pytest.mark.slow  # the base model is trained first where `make` has not
def test_answers_generated_in_padded_batches_are_those_of_one_prompt_at_a_time(base_run,
                                                                               question_set,
                                                                               chunks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = KIT_ROOT / "models" / "kit-tiny"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), \
        AutoTokenizer.from_pretrained(path)
    prompts = [rag.prompt_for(q, [c.text for c in chunks[i:i + (i % 3)]], tokenizer, 100)
               for i, q in enumerate(question_set[:5])]
    assert len({len(tokenizer(p)["input_ids"]) for p in prompts}) > 1  # padding is needed
    batched = rag.generate(model, tokenizer, prompts, 12, batch_size=5)
    assert batched == [rag.generate(model, tokenizer, [p], 12)[0] for p in prompts]
    assert len(batched) == 5 and all(isinstance(a, str) for a in batched)


def test_the_extracted_answer_is_the_first_sentence_below_the_title():
    assert rag.extracted_answer("json.dumps(obj)\nSerialize obj. More text.") == "Serialize obj."
