"""The built-in scorers (`trainbook.rewards`), called as `trainbook eval` calls a scorer."""

from __future__ import annotations

from trainbook.rewards import exact_answer, has_number, last_number


def test_exact_answer_compares_the_last_number_with_the_answer():
    completions = ["2+3 = 5.", "It is 14", "1,024", "7.0", "maybe 3 or 4", "no idea", "-6", "5\n", "050"]
    answers = [5, "14", 1024, 7, 3, 3, "-6", " 5 ", 50]
    assert exact_answer(["p"] * 9, completions, answer=answers, tag=list("abcdefghi")) == [
        1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert last_number("x 12, then 13.5!") == "13.5" and last_number("none") is None
    assert has_number(["p", "p"], ["a 1", "b"]) == [1.0, 0.0]
