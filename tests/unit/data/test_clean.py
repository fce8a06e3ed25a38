from __future__ import annotations

from trainbook.config.data import CleanConfig
from trainbook.data.clean import COUNT_KEYS, Cleaner


def test_nfc_composes_and_is_counted():
    cleaner = Cleaner(CleanConfig())
    assert cleaner("cafe\u0301") == "caf\u00e9"
    assert cleaner("caf\u00e9") == "caf\u00e9"  # already NFC: unchanged, not counted
    assert cleaner.counts["nfc_changed"] == 1
    assert Cleaner(CleanConfig(nfc=False))("cafe\u0301") == "cafe\u0301"


def test_control_characters_go_but_tab_newline_and_format_characters_stay():
    cleaner = Cleaner(CleanConfig())
    text = "a\x00b\tc\nd\x1b[0me\x7f\x85f\r\u200dg"
    assert cleaner(text) == "ab\tc\nd[0mef\u200dg"
    assert cleaner.counts["control_chars_removed"] == 5  # NUL, ESC, DEL, NEL, CR
    assert Cleaner(CleanConfig(strip_control=False))(text) == text


def test_length_limits_apply_after_cleaning_and_counts_add_up():
    cleaner = Cleaner(CleanConfig(min_chars=3, max_chars=5))
    texts = ["abc", "a\x00\x00b", "abcde", "abcdef", "e\u0301e\u0301e\u0301"]
    results = [cleaner(t) for t in texts]
    # "a\0\0b" is 2 characters once cleaned; three "e + accent" are 3 once composed.
    assert results == ["abc", None, "abcde", None, "\u00e9\u00e9\u00e9"]
    assert cleaner.counts == {
        "documents_in": 5,
        "documents_out": 3,
        "dropped_too_short": 1,
        "dropped_too_long": 1,
        "control_chars_removed": 2,
        "nfc_changed": 1,
    }
    assert tuple(cleaner.counts) == COUNT_KEYS
