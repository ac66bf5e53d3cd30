"""planner.errors: the error text is one printable line."""

from planner.errors import brief


def test_printable_escapes_what_would_break_a_line():
    from planner.errors import PlanError, printable

    assert printable("model.layers.0.q_proj é") == "model.layers.0.q_proj é"
    assert printable("a\nb\x1b[2J\ud800\u202e") == "a\\nb\\x1b[2J\\ud800\\u202e"
    assert str(PlanError("bad\nname")) == "bad\\nname"


def test_brief_keeps_a_short_first_line_and_cuts_a_long_one():
    assert brief(ValueError("bad value")) == "bad value"
    assert brief(ValueError("first line\nsecond line")) == "first line"
    cut = brief(ValueError("Model type should be one of " + ", ".join(f"C{i}Config" for i in range(300))))
    assert len(cut) == 160 and cut.endswith(" ...")
    assert brief(ValueError("")) == "ValueError"
    assert brief("a\x1b[2Jb") == "a\\x1b[2Jb"
