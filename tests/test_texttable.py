"""Plain-text tables line up on a terminal, where a Chinese character takes two columns."""

from __future__ import annotations

from kvwatch import texttable

MODEL = "通义千问-32B"  # 4 wide characters: 12 columns, 8 characters


def test_wide_characters_take_two_columns_and_combining_marks_none() -> None:
    assert texttable.columns(MODEL) == 12
    assert texttable.columns("e\u0301") == 1  # é as e + combining acute


def test_columns_line_up_by_what_the_terminal_shows() -> None:
    text = texttable.render(("model", "used"), [(MODEL, "1%"), ("qwen", "10.5%")])
    assert {texttable.columns(line) for line in text.splitlines()} == {19}  # 12 + 2 + 5, right-aligned


def test_a_cut_never_splits_a_wide_character_past_the_width() -> None:
    assert texttable.cut(MODEL, 3) == "通"
    assert texttable.cut(MODEL, 4) == "通义"
    assert texttable.cut("abc", 10) == "abc"
    assert all(texttable.columns(texttable.cut(MODEL, w)) <= w for w in range(14))
