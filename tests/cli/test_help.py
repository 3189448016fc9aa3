"""The top-level ``tuner --help`` lists each command with its whole first sentence (operator review 2, D10)."""

from __future__ import annotations

import typer

from tuner.cli import app


def test_every_command_s_one_liner_in_the_top_level_help_ends_at_a_sentence_s_end() -> None:
    """Click cuts a command's short help at the first period followed by a space, so a docstring
    without its own ``short_help`` that read "Copy a study between storages (SQLite <-> PostgreSQL), e.g. to share ..." was listed
    as "... e.g.": the listed text must be followed, in the docstring's first paragraph, by nothing
    or by a new sentence (a capital letter)."""
    group = typer.main.get_command(app)
    ctx = group.make_context("tuner", [], resilient_parsing=True)  # type: ignore[attr-defined]
    cut = {}
    for name in group.list_commands(ctx):  # type: ignore[attr-defined]
        command = group.get_command(ctx, name)  # type: ignore[attr-defined]
        assert command is not None and command.help, name
        if command.short_help:  # written for the listing on purpose
            continue
        paragraph = " ".join(command.help.strip().split("\n\n")[0].split())
        shown = command.get_short_help_str(limit=len(paragraph) + 1)
        assert paragraph.startswith(shown), (name, shown)
        rest = paragraph[len(shown):].strip()
        if rest and not rest[0].isupper():
            cut[name] = f"{shown!r} cuts {paragraph!r}"
    assert not cut, cut
