"""`[data]` and `[tokenizer]`: the corpus (its sources, the cleaning and deduplication applied to
them, shards and batches) and the tokenizer that cuts it into tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainbook.config.section import Section


class SourceConfig(Section):
    name: str
    """Source name, used in reports and metrics."""
    paths: list[str] = Field(min_length=1)
    """Globs of input files; `pkg://PACKAGE/sub/dir/*.md` resolves inside an installed package."""
    format: Literal["text", "markdown", "jsonl", "parquet", "chat", "prompt_completion", "prompts",
                    "preference"] = "text"
    """`text`: one document per file (or per `separator`); `markdown`: same, markup stripped;
    `jsonl`: one document per line, in `text_field`; `parquet`: one per row of column `text_field`;
    `chat`: JSONL of conversations (`messages_field`: a list of `{role, content}`), rendered with
    the chat template; `prompt_completion`: JSONL with `prompt_field` and `completion_field`, both
    strings (joined as written) or both message lists (rendered with the chat template);
    `prompts` (reinforcement learning, `[grpo]`): JSONL with `prompt` (a string, or messages
    ending with the user's turn, rendered with the chat template and its generation prompt) or
    `messages`, and any other fields, which the reward functions receive as columns;
    `preference` (`[dpo]`): JSONL with `prompt_field`, `chosen` and `rejected`, all strings
    (joined as written) or a message-list prompt and message-list completions (rendered with the
    chat template), each completion trained as `prompt_completion` trains one."""
    messages_field: str = "messages"
    """`chat`: the field that holds a record's messages."""
    prompt_field: str = "prompt"
    """`prompt_completion`, `preference`: the field that holds the prompt."""
    completion_field: str = "completion"
    """`prompt_completion`: the field that holds the completion (the trained part)."""
    separator: str | None = None
    """`text`/`markdown`: split each file into documents on this string; unset: one per file."""
    text_field: str = "text"
    """`jsonl`: the field that holds the text; `parquet`: the column."""
    start_after: str | None = None
    """`text`/`markdown`: keep only what follows the first occurrence of this string in each file
    (e.g. Project Gutenberg's "*** START OF THE PROJECT GUTENBERG EBOOK"); a file without it is an error."""
    end_before: str | None = None
    """`text`/`markdown`: keep only what precedes the next occurrence of this string (after
    `start_after`, when set); a file without it is an error."""
    compression: Literal["auto", "none", "gzip", "zstd"] = "auto"
    """`auto` decides by file suffix (`.gz`, `.zst`); `parquet` files carry their own compression."""
    on_invalid_utf8: Literal["replace", "skip", "fail"] = "fail"
    """Bytes that are not UTF-8: replace them with U+FFFD, skip the document, or stop with an error."""
    weight: float = Field(default=1.0, gt=0)
    """Relative sampling weight of this source in the training mixture."""

    @model_validator(mode="after")
    def _markers_on_text(self) -> SourceConfig:
        if (self.start_after is not None or self.end_before is not None) and self.format not in ("text", "markdown"):
            raise ValueError(f"start_after and end_before apply to text and markdown files, not {self.format}")
        if "" in (self.start_after, self.end_before):
            raise ValueError("an empty marker; remove the key to keep the whole file")
        return self


class CleanConfig(Section):
    nfc: bool = True
    """Normalise text to Unicode NFC."""
    strip_control: bool = True
    """Remove control characters other than tab and newline."""
    min_chars: int = Field(default=1, ge=0)
    """Drop documents shorter than this after cleaning."""
    max_chars: int | None = Field(default=None, ge=1)
    """Drop documents longer than this after cleaning; unset: no limit."""


class DedupConfig(Section):
    exact: bool = True
    """Drop documents whose cleaned text was already seen (sha256)."""
    near: bool = False
    """Drop near-duplicates: MinHash signatures with LSH over word shingles."""
    shingle_size: int = Field(default=5, ge=1)
    """Words per shingle for near-duplicate detection."""
    threshold: float = Field(default=0.8, gt=0, le=1)
    """Estimated Jaccard similarity at or above which a document is a near-duplicate."""
    num_perm: int = Field(default=128, ge=16)
    """MinHash permutations (more: slower, more precise)."""


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=list)
    """The corpus: a list of sources (`[[data.sources]]` tables)."""
    clean: CleanConfig = CleanConfig()
    """Cleaning applied to every document before deduplication and tokenization."""
    dedup: DedupConfig = DedupConfig()
    """Exact and near-duplicate removal across all sources."""
    cache_dir: str = ".trainbook/cache"
    """Where prepared token shards are cached, keyed by the hash of the inputs and tokenizer."""
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of documents held out for validation (at least one document when > 0)."""
    shard_tokens: int = Field(default=50_000_000, ge=1024)
    """Maximum tokens per shard file."""
    num_proc: int = Field(default=1, ge=1)
    """Processes that tokenize during `prepare`."""
    packing: Literal["concat", "document", "pad"] = "concat"
    """`concat`: documents joined with EOS and cut into windows; `document`: the same windows, but
    positions restart and attention stops at every document boundary; `pad` (chat and
    prompt_completion data): one document per sample, right-padded to seq_len + 1 tokens (cut
    there when longer), padding never trained nor attended (data/samples.py)."""
    num_workers: int = Field(default=0, ge=0)
    """Background processes that assemble batches; 0 assembles them in the training process."""
    pin_memory: bool | None = None
    """Page-lock batches for faster host-to-device copies; unset: on when training on an accelerator."""


class TokenizerConfig(Section):
    kind: Literal["train_bpe", "hf", "sentencepiece", "tiktoken"] = "train_bpe"
    """`train_bpe`: train a byte-level BPE on the corpus; `hf`: a `tokenizer.json`; `sentencepiece`:
    a `.model` file; `tiktoken`: a tiktoken rank file (`.tiktoken`) or GPT-2 `encoder.json` + `vocab.bpe`."""
    path: str | None = None
    """Tokenizer file (for `tiktoken` GPT-2 files: the directory holding them); `pkg://PACKAGE/path`
    is a file inside an installed package."""
    vocab_size: int = Field(default=2048, ge=260)
    """Vocabulary size when training a tokenizer (256 bytes + specials + merges)."""
    eos_token: str | None = None
    """End-of-document token placed between packed documents; unset: the tokenizer's own
    (`<|endoftext|>` for trained and tiktoken BPEs, the model's EOS for SentencePiece)."""
    bos_token: str | None = None
    """Beginning-of-document token; unset: the tokenizer's own, if it has one."""
    pad_token: str | None = None
    """Padding token; unset: the tokenizer's own, if it has one."""
    chat_template: str | None = None
    """A jinja file (or `pkg://PACKAGE/path`) with the chat template for `chat` and
    `prompt_completion` data; unset: the `chat_template` of the `tokenizer_config.json` beside
    `tokenizer.path`."""
    add_bos: bool = False
    """Put the BOS token at the start of every document."""
    tiktoken_encoding: Literal["cl100k_base", "o200k_base", "llama3"] | None = None
    """`tiktoken` rank file: the encoding it belongs to, which fixes what the file does not hold,
    the split regex and the special tokens: `cl100k_base` (GPT-4), `o200k_base` (GPT-4o), each
    as tiktoken defines it; `llama3` (Meta Llama 3: BOS `<|begin_of_text|>`, EOS
    `<|end_of_text|>`, 256 specials from id 128000). Unset: GPT-2's regex and `<|endoftext|>`
    at the first id no rank uses (right for `r50k_base` and `p50k_base`)."""
    tiktoken_pattern: str | None = None
    """`tiktoken` rank file: the split regex (tiktoken's syntax), in place of the encoding's."""
    tiktoken_special_tokens: dict[str, int] | None = None
    """`tiktoken` rank file: special token -> id (ids no rank uses), in place of the encoding's;
    e.g. Llama 3.1's names for the reserved ids. EOS/BOS default to `<|endoftext|>` or
    `<|end_of_text|>`, and `<|begin_of_text|>`, where present."""

    @field_validator("tiktoken_encoding", "tiktoken_pattern", "tiktoken_special_tokens")
    @classmethod
    def _tiktoken_only(cls, value, info: ValidationInfo):
        kind = info.data.get("kind")
        if value is not None and kind != "tiktoken":
            raise ValueError(f"applies to kind 'tiktoken' only, not '{kind}'")
        return value
