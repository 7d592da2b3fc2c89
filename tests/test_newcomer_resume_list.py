"""Issue 41 point 4: the fields that may change on ``--resume`` come from one place, ``RESUME_MAY_CHANGE``:
the refusal lists the config class's set, and platform/README.md's list is compared here with the
constant and with each resumable command's additions (every leaf command with ``--resume``)."""

from __future__ import annotations

import re
from pathlib import Path

from cliwalk import leaf_parsers, option

README = Path(__file__).resolve().parents[1] / "platform" / "README.md"


def _readme_lists() -> tuple[set[str], dict[str, set[str]]]:
    """(the base list, {"pctr train": its additions}) from the README's resume paragraph."""
    text = README.read_text()
    start = text.index("except those that may change")
    para = text[start : text.index("`lr` and `weight_decay` are not among them", start)]
    lines = para.split("\n")[2:]  # after the sentence that introduces the list
    base = set(re.findall(r"`([a-z_]+)`", lines[0]))
    adds = {}
    for line in lines[1:]:
        m = re.match(r"`([a-z]+ [a-z-]+)` adds (.*)", line)
        if m:
            adds[m.group(1)] = set(re.findall(r"`([a-z_]+)`", m.group(2)))
    return base, adds


def test_the_readme_lists_exactly_the_fields_resume_may_change():
    from mariana.platform.core.config import RESUME_MAY_CHANGE

    base, adds = _readme_lists()
    assert base == set(RESUME_MAY_CHANGE), sorted(base ^ set(RESUME_MAY_CHANGE))
    expected = {}
    for path, parser in leaf_parsers():
        cls = (parser.get_default("_config") or (None,))[0]
        if option(parser, "--resume") and cls is not None:
            extra = set(cls.RESUME_MAY_CHANGE) - set(RESUME_MAY_CHANGE)
            if extra:
                expected[" ".join(path)] = extra
    assert expected and adds == expected


def test_the_refusal_lists_the_same_set(tmp_path: Path):
    import pytest
    from mariana.apps.mlp.configs import MlpConfig
    from mariana.platform.core.config import save_config
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.core.rundir import check_resume_config

    save_config(MlpConfig(out=str(tmp_path), lr=0.5), tmp_path / "config.toml")
    with pytest.raises(MarianaError) as e:
        check_resume_config(MlpConfig(out=str(tmp_path), lr=0.25), tmp_path)
    listed = str(e.value).rpartition("may change on resume: ")[2].rstrip(")")
    assert set(listed.split(", ")) == set(MlpConfig.RESUME_MAY_CHANGE)
