"""The shared bits of ``kvwatch rules`` / ``kvwatch dashboards``: refusing and the regenerate hint."""

from __future__ import annotations

import io

from kvwatch.mixin.output import command_line, refused


def test_regenerate_hint_names_only_options_that_differ_from_their_default():
    assert command_line("kvwatch rules --out x", [("--job", "kvwatch", "kvwatch")]) == "kvwatch rules --out x"
    assert (
        command_line("kvwatch rules --out x", [("--job", "kv", "kvwatch"), ("--runbook-base", "u", "v")])
        == "kvwatch rules --out x --job kv --runbook-base u"
    )


def test_refusal_lists_every_problem_and_nothing_without_problems():
    err = io.StringIO()
    assert refused("rules", ["a: kvwatch_nope", "b: kvwatch_nada"], err) is True
    assert err.getvalue() == (
        "refusing to write rules that query series kvwatch does not export:\n"
        "  a: kvwatch_nope\n  b: kvwatch_nada\n"
    )
    quiet = io.StringIO()
    assert refused("dashboards", [], quiet) is False and quiet.getvalue() == ""
