"""Issue 41 point 9: a ``--token-file`` whose token no client can send as ``Authorization: Bearer`` is
refused at start by both servers (one line naming the file and line, exit 2), and ``MARIANA_CPU_KERNELS``
takes only its documented values (``on``/``off``, also ``1``/``yes``, ``0``/``no``, or unset), with the
warning the pctr README promises for ``off``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cliwalk import run_main

BAD_TOKENS = {
    "two lines": ("abc\ndef\n", "line 2"),
    "a space": ("abc def", "line 1"),
    "a tab": ("abc\tdef", "line 1"),
    "a control char": ("abc\x01def", "line 1"),
    "non-ascii": ("abcédef", "line 1"),
}
SERVERS = (["serve", "--pctr", "RUN"], ["jobs", "serve"])


@pytest.mark.parametrize("server", SERVERS, ids=lambda a: " ".join(a[:2]))
@pytest.mark.parametrize("name", sorted(BAD_TOKENS))
def test_a_token_no_client_can_send_is_refused_at_start(tmp_path: Path, capsys, server, name):
    text, where = BAD_TOKENS[name]
    token_file = tmp_path / "token"
    token_file.write_text(text)
    argv = [a if a != "RUN" else str(tmp_path) for a in server]
    rc, out, err = run_main([*argv, "--token-file", token_file, "--port", "0"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert str(token_file) in lines[0] and where in lines[0] and "Bearer" in lines[0], lines[0]


def test_a_sendable_token_is_read_with_its_newline_stripped(tmp_path: Path):
    from mariana.platform.jobs.client import read_token

    (tmp_path / "token").write_text("s3cr3t-T0ken_~+/=\n")
    assert read_token(str(tmp_path / "token")) == "s3cr3t-T0ken_~+/="


@pytest.mark.parametrize("value", ["maybe", "true-ish", "2", ""])
def test_an_undocumented_cpu_kernels_value_is_refused(monkeypatch, value):
    from mariana.platform.core.errors import MarianaError
    from mariana.platform.sparse import kernels as cpu_rows

    monkeypatch.setenv("MARIANA_CPU_KERNELS", value)
    with pytest.raises(MarianaError, match="MARIANA_CPU_KERNELS=.*expected on or off"):
        cpu_rows.kernels_enabled()


def test_cpu_kernels_off_logs_the_promised_warning(monkeypatch, caplog):
    from mariana.platform.sparse import kernels as cpu_rows

    monkeypatch.setenv("MARIANA_CPU_KERNELS", "OFF")
    cpu_rows.kernels.cache_clear()
    # caplog's handler on the platform logger itself: an in-process CLI run earlier in the same worker may have
    # set 'mariana' not to propagate to the root logger, where caplog listens by default.
    cpu_rows.log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_rows.log.name):
            assert cpu_rows.kernels() is None
    finally:
        cpu_rows.log.removeHandler(caplog.handler)
        cpu_rows.kernels.cache_clear()
    assert any("MARIANA_CPU_KERNELS=off" in r.getMessage() for r in caplog.records), caplog.text
