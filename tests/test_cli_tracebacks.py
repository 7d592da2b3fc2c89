"""Issue 30.14: no traceback where a user can provoke one. Generated over the parser: every command's
output into a closed pipe (``mariana ... | head -1``) ends quietly with exit 141 (128 + SIGPIPE), and
every command with --rdzv-endpoint refuses a malformed, an unknown and an unreachable endpoint in one
line, exit 2, within 10 s (torchrun printed ~40 lines, or waited out its rendezvous timeout)."""

import subprocess
import sys
import time

import pytest
from cliwalk import leaf_parsers, option, run_main
from helpers import ROOT, cli_env, free_port

COMMANDS = [path for path, _ in leaf_parsers()]
RDZV = [path for path, p in leaf_parsers() if option(p, "--rdzv-endpoint")]
# commands whose rendezvous is that of their parameter servers (pctr train): --rdzv-endpoint applies with them
WITH_SERVERS = {path for path, p in leaf_parsers() if option(p, "--servers")}


class ClosedPipe:
    """A piped (block-buffered) stdout whose reader has gone: writes are buffered, the flush that sends
    them raises BrokenPipeError, as a real closed pipe does."""

    def __init__(self):
        self.pending = 0

    def write(self, text):
        self.pending += len(text)
        return len(text)

    def flush(self):
        if self.pending:
            raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_output_into_a_closed_pipe_is_quiet(cmd, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    rc, out, err = run_main([*cmd, "--help"], capsys)
    assert rc == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_command_writing_into_a_closed_pipe_is_quiet(tmp_path, data_dir, monkeypatch, capsys):
    data = tmp_path / "f.libfm"
    data.write_text(
        "\n".join((data_dir / "frappe" / "frappe.validation.libfm").read_text().splitlines()[:100])
    )
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    argv = ["mlp", "train", "--data", data, "--out", tmp_path / "r", "--preset", "debug", "--max-steps", "1"]
    rc, out, err = run_main([*argv, "--batch-size", "16", "--no-progress"], capsys)
    assert rc == 141 and "Traceback" not in err, err


def test_real_closed_pipe():
    """The real thing once: the reader closes its end before the command writes its help (stdout
    block-buffered, as in any user's pipe)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "mariana.platform.cli", "jobs", "--help"],
        cwd=ROOT, env=cli_env({"PYTHONUNBUFFERED": ""}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


BAD_ENDPOINTS = {
    "malformed": ("notahost:abc", "expected HOST:PORT"),
    "unknown-host": ("no-such-host.invalid:29500", "unknown host"),
    "unreachable": (f"192.0.2.1:{free_port()}", "cannot connect"),  # TEST-NET-1: never a machine here
}


@pytest.mark.parametrize("kind", sorted(BAD_ENDPOINTS))
@pytest.mark.parametrize("cmd", RDZV, ids=" ".join)
def test_bad_rendezvous_endpoint_is_one_line(cmd, kind, tmp_path, capsys, monkeypatch):
    endpoint, fragment = BAD_ENDPOINTS[kind]
    monkeypatch.setenv("MARIANA_RDZV_WAIT", "0")  # one try (the wait: tests/test_multihost_rdzv.py)
    data = tmp_path / "d.txt"
    data.write_text("1 0:1\n")
    t0 = time.monotonic()
    argv = [*cmd, "--data", data, "--out", tmp_path / "r", "--workers", "2", "--nnodes", "2"]
    argv += ["--servers", "2"] if tuple(cmd) in WITH_SERVERS else []
    rc, out, err = run_main([*argv, "--rdzv-endpoint", endpoint], capsys)
    assert time.monotonic() - t0 <= 10
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


C10D_WARNING = """
import datetime, gc, sys
from mariana.platform.cli.main import run
sys.argv = ["mariana", "--version"]  # loads torch, as every command that trains does
try:
    run()
except SystemExit:
    pass
import torch.distributed as dist
t = datetime.timedelta(seconds=5)
master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=t, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=t)
client.set("k", "v")
del master  # the store's host ended first, as a multi-node job's first node may
gc.collect()
try:  # torchrun's closing of the rendezvous: c10d logs a warning with a C++ stack dump, then raises
    client.compare_set("k", "v", "w")
except Exception as e:
    print("raised", type(e).__name__)
"""


@pytest.mark.parametrize("preset", [None, "WARNING"])
def test_c10d_cpp_warnings_stay_off_the_console(preset):
    """A store call to a host whose job already ended (the end of a multi-node job) makes c10d log a
    warning with a C++ stack dump; the CLI keeps them off the console unless TORCH_CPP_LOG_LEVEL asks."""
    env = cli_env({"TORCH_CPP_LOG_LEVEL": preset} if preset else None)
    env.pop("TORCH_CPP_LOG_LEVEL", None) if preset is None else None
    p = subprocess.run([sys.executable, "-c", C10D_WARNING], capture_output=True,
                       text=True, env=env, timeout=60)  # fmt: skip
    assert "raised DistNetworkError" in p.stdout or "raised TimeoutError" in p.stdout, (
        p.stdout + p.stderr[-2000:]
    )
    assert ("Exception raised from" in p.stderr) == (preset == "WARNING"), p.stderr[-2000:]
