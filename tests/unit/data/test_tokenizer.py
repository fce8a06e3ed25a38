from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from trainbook.config.schema import TokenizerConfig
from trainbook.data.tokenizer import PIECE_CHARS, Tokenizer, build_tokenizer, train_bpe
from trainbook.errors import TrainbookError

from .conftest import EOS


def _random_unicode(rng: random.Random, n: int) -> str:
    # Scripts, emoji, combining marks, odd whitespace (NBSP, U+2028, U+3000, \x1c, \x85) and
    # control characters: none of it needs to be in the training text.
    alphabet = (
        "abc XYZ 019 \n\t\r.,;'\"-_*#"
        "éüñßøÆ ΩЖжשלוםمرحبا 日本語 한국어 ไทย 😀🎭👩‍👩‍👧 e\u0301 "
        "\u00a0\u2028\u3000\u180e\u200b\x1c\x85\x00\x7f"
    )
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_round_trip_on_shakespeare_and_arbitrary_unicode(small_tokenizer, hamlet):
    rng = random.Random(0)
    texts = [hamlet[:20_000], "", " leading and trailing spaces  ", f"a literal {EOS} in text"]
    texts += [_random_unicode(rng, 300) for _ in range(20)]
    for text in texts:
        ids = small_tokenizer.encode(text)
        assert small_tokenizer.decode(ids) == text
        assert all(0 <= i < small_tokenizer.vocab_size for i in ids)
    assert small_tokenizer.encode_batch(texts) == [small_tokenizer.encode(t) for t in texts]


def test_eos_in_text_is_text_and_only_packing_places_eos(small_tokenizer):
    assert small_tokenizer.eos_id == 0  # the one special token comes first
    assert small_tokenizer.eos_id not in small_tokenizer.encode(f"x{EOS}y")
    assert small_tokenizer.decode([small_tokenizer.eos_id]) == EOS


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


def test_save_load_keeps_ids_and_hash(small_tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    small_tokenizer.save(path)
    loaded = Tokenizer.load(path, EOS)
    assert loaded.sha256 == small_tokenizer.sha256
    assert (loaded.vocab_size, loaded.eos_id) == (
        small_tokenizer.vocab_size,
        small_tokenizer.eos_id,
    )
    assert loaded.encode("To be, or not to be") == small_tokenizer.encode("To be, or not to be")
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left


def test_small_corpus_stops_short_of_vocab_size():
    tok = train_bpe(["aaaa bbbb"], vocab_size=1000, eos_token=EOS)
    assert 257 <= tok.vocab_size < 1000  # 256 bytes + EOS + the few merges there are
    assert tok.decode(tok.encode("never seen: zq€")) == "never seen: zq€"


def test_build_tokenizer_trains_or_loads(small_tokenizer, tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return iter(["some training text"] * 3)

    trained = build_tokenizer(TokenizerConfig(kind="train_bpe", vocab_size=300), texts)
    assert calls == [1] and trained.vocab_size <= 300

    path = tmp_path / "tok.json"
    small_tokenizer.save(path)
    loaded = build_tokenizer(TokenizerConfig(kind="hf", path=str(path)), texts)
    assert loaded.sha256 == small_tokenizer.sha256 and calls == [1]  # loading reads no text


@pytest.mark.parametrize(
    "cfg, where, message",
    [
        (TokenizerConfig(kind="hf"), "tokenizer.path", "needs"),
        (
            TokenizerConfig(kind="hf", path="/no/such/tokenizer.json"),
            "tokenizer.path",
            "no tokenizer",
        ),
    ],
)
def test_build_tokenizer_errors(cfg, where, message):
    with pytest.raises(TrainbookError, match=message) as err:
        build_tokenizer(cfg, lambda: iter([]))
    assert err.value.where == where


def test_eos_missing_from_vocab_and_bad_file_are_errors(small_tokenizer, tmp_path):
    path = tmp_path / "tok.json"
    small_tokenizer.save(path)
    with pytest.raises(TrainbookError, match="no token '</s>'") as err:
        build_tokenizer(TokenizerConfig(kind="hf", path=str(path), eos_token="</s>"), list)
    assert err.value.where == "tokenizer.eos_token"

    path.write_text("{not json")
    with pytest.raises(TrainbookError, match="not a tokenizers JSON") as err:
        Tokenizer.load(path, EOS)
    assert err.value.where == "tokenizer.path"
