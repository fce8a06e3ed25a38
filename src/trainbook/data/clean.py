"""Cleaning: one document in, the cleaned document (or None: dropped) out, with counts.

Runs after reading and before deduplication, so duplicates are found on the text the model will
see. One `Cleaner` per source, so its `counts` are that source's.
"""

from __future__ import annotations

import re
import unicodedata

from trainbook.config.data import CleanConfig

# Unicode category Cc (C0 controls, DEL, C1 controls) except tab and newline. Only Cc: format
# characters (Cf: zero-width joiners, soft hyphens, direction marks) carry meaning in some
# scripts and emoji, so they stay. Sources have already turned CRLF into LF, so a "\r" left here
# is a stray one.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

COUNT_KEYS = (
    "documents_in",
    "documents_out",
    "dropped_too_short",
    "dropped_too_long",
    "control_chars_removed",
    "nfc_changed",
)


class Cleaner:
    """`cleaner(text)` -> the cleaned text, or None when the document is dropped.

    `counts`: documents in and out, documents dropped as too short / too long (in characters,
    after cleaning), control characters removed, documents that NFC changed.
    """

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)

    def __call__(self, text: str) -> str | None:
        cfg, counts = self.cfg, self.counts
        counts["documents_in"] += 1
        if cfg.nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
            counts["nfc_changed"] += 1
        if cfg.strip_control:
            text, removed = _CONTROL.subn("", text)
            counts["control_chars_removed"] += removed
        if len(text) < cfg.min_chars:
            counts["dropped_too_short"] += 1
            return None
        if cfg.max_chars is not None and len(text) > cfg.max_chars:
            counts["dropped_too_long"] += 1
            return None
        counts["documents_out"] += 1
        return text
