"""Issue 41 point 1: an unmarked folder is a run only when the project's own files prove it (a config.toml
that parses as the command's sections plus checkpoints/latest or metrics.jsonl), never by a file name.
Generated over every run-directory flag (reuse ``run``) of every leaf command (`cliwalk.leaf_parsers`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cliwalk import leaf_parsers

RUN_FLAGS = [
    (" ".join(path), parser)
    for path, parser in leaf_parsers()
    for flag, _command, reuse in (parser.get_default("_outputs") or {}).values()
    if reuse == "run"
]
USER_FOLDERS = {
    "a user's metrics.json": {"metrics.json": '{"auc": 0.9}'},
    "a user's config.toml": {"config.toml": '[tool]\nname = "mine"\n', "metrics.jsonl": "{}\n"},
    "a user's checkpoints/": {"checkpoints/notes.txt": "mine"},
    "a model file": {"model.safetensors": "x"},
}


def _fill(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


@pytest.mark.parametrize("kind", sorted(USER_FOLDERS))
@pytest.mark.parametrize("command,parser", RUN_FLAGS, ids=[c for c, _ in RUN_FLAGS])
def test_a_user_folder_is_not_taken_for_a_run(tmp_path: Path, command, parser, kind):
    from mariana.platform.cli.outputs import guard_output
    from mariana.platform.core.errors import MarianaError

    _fill(tmp_path, USER_FOLDERS[kind])
    cls = parser.get_default("_config")[0]
    with pytest.raises(MarianaError, match="did not create"):
        guard_output(str(tmp_path), "--out", command, "run", False, create=False, config_cls=cls)


@pytest.mark.parametrize("proof", ["checkpoints/latest", "metrics.jsonl"])
@pytest.mark.parametrize("command,parser", RUN_FLAGS, ids=[c for c, _ in RUN_FLAGS])
def test_an_unmarked_run_proven_by_its_own_files_is_a_run(tmp_path: Path, command, parser, proof):
    from mariana.platform.cli.outputs import guard_output
    from mariana.platform.core.config import save_config

    cls = parser.get_default("_config")[0]
    save_config(cls(out=str(tmp_path)), tmp_path / "config.toml")
    _fill(tmp_path, {proof: "step_00000004\n"})
    assert (
        guard_output(str(tmp_path), "--out", command, "run", False, create=False, config_cls=cls) == tmp_path
    )
