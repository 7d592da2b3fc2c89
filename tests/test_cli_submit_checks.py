"""Issue 30.11 (submit): `mariana submit` refuses, before queueing and with the command's own message,
a job whose arguments the command would refuse (the service is never contacted: --url points at a
closed port, so a job that passes gets "no job service" instead)."""

import pytest
from cliwalk import run_main
from helpers import free_port

BAD = [
    (["pctr", "train", "--data", "x", "--batch-size", "-4"], "--batch-size must be >= 1"),
    (["pctr", "train", "--data", "x", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["mlp", "train", "--out", "r"], "--data is required"),
    (
        ["vision", "train", "--data", "x", "--eval-data", "x", "--monitor", "auc"],
        "--monitor auc: the evaluation reports no such",
    ),
    (["pctr", "eval", "--data", "x"], "the following arguments are required: --model"),
]


@pytest.fixture(scope="module")
def url():
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("job,fragment", BAD, ids=[" ".join(j[:2]) + " " + j[-1] for j, _ in BAD])
def test_refused_before_queueing(job, fragment, url, capsys):
    rc, out, err = run_main(["submit", "--url", url, *job], capsys)
    assert rc == 2 and fragment in err and "no job service" not in err, err


def test_valid_job_goes_on_to_the_service(url, data_dir, capsys):
    # its --data must exist (issue 41.12: submit checks what the command checks before training)
    frappe = data_dir / "frappe" / "frappe.validation.libfm"
    rc, out, err = run_main(
        ["submit", "--url", url, "pctr", "train", "--data", frappe, "--batch-size", "4"], capsys
    )
    assert rc == 2 and "no job service" in err, err


@pytest.mark.parametrize("nodes,fragment", [("2", "no job service"), ("3", "--workers 3 is not divisible")])
def test_a_multi_node_job_is_checked_as_its_agents_run_it(nodes, fragment, url, data_dir, capsys):
    # --nodes N: each Slurm task runs the command with --nnodes N (2 pipeline stages on 2 hosts, 1 each)
    cifar = data_dir / "cifar10" / "train.tar"
    job = ["vision", "train", "--data", cifar, "--workers", "1", "--model-parallel", "2"]
    rc, out, err = run_main(["submit", "--url", url, "--nodes", nodes, *job], capsys)
    assert rc == 2 and fragment in err, err
