"""Issue 41 point 12 (the serving part): the reload roots a 403 lists are each named once, however they
were given (several served runs in one folder, a --reload-root repeated or reached through a symlink)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("given", ["runs of one folder", "a repeated --reload-root", "a symlinked root"])
def test_each_reload_root_is_listed_once(tmp_path: Path, given):
    from mariana.serving.context import ServeConfig

    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        (runs / name).mkdir(parents=True)
    (tmp_path / "link").symlink_to(runs)
    models = {app: str(runs / name) for app, name in zip(("pctr", "vision", "asr"), "abc", strict=True)}
    roots = {
        "runs of one folder": [],
        "a repeated --reload-root": [str(runs), str(runs), str(runs) + "/"],
        "a symlinked root": [str(runs), str(tmp_path / "link")],
    }[given]
    assert ServeConfig(models=models, reload_roots=roots).roots() == [runs.resolve()]


def test_help_shows_no_stored_sentinel_as_a_default():
    """Issue 41 point 12: ``--eval-every``'s help said ``(default: -1)``, the value 'epoch' is stored as.
    Generated over every flag of every leaf command: a help shows ``(default: -1)`` only where it says what
    -1 means (``--staleness``: "-1 fully asynchronous")."""
    import re

    from cliwalk import leaf_parsers

    shown = []
    for path, parser in leaf_parsers():
        for action in parser._actions:
            help_ = action.help or ""
            if re.search(r"\(default: -1\)", help_) and not re.search(r"(^|\W)-1 \w", help_):
                shown.append((" ".join(path), action.option_strings[0]))
    assert not shown, shown
