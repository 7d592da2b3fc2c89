"""The TDNN acoustic model (`--arch tdnn`): per-utterance edge padding, receptive field, build/export/load,
and the whole CLI path (data-parallel training, eval, transcribe)."""

import dataclasses
import json

import pytest
import torch
from helpers import last_line, run_cli
from mariana.apps.asr.model import AcousticDNN, AcousticTDNN, build_model, tdnn_dilations
from trained_runs import cli_here


def _tdnn(**kw) -> AcousticTDNN:
    torch.manual_seed(0)
    args = dict(num_bins=6, context=7, hidden=16, layers=3, output_units=5, norm="layer", dropout=0.2)
    return AcousticTDNN(**(args | kw)).eval()


@pytest.mark.parametrize("lengths", [(13, 7), (13, 2), (1, 13)])
def test_padded_batch_gives_each_utterance_its_own_outputs(lengths):
    m = _tdnn()
    assert m.receptive == 7  # both utterances of the (13, 2) case are shorter than the +-7 frame window
    torch.manual_seed(1)
    t = max(lengths)
    feats = torch.randn(2, t, 6)
    for i, n in enumerate(lengths):
        feats[i, n:] = 99.0  # padding: must never reach a valid frame's output
    with torch.no_grad():
        batch = m(feats, torch.tensor(lengths))
        assert batch.shape == (2, t, 5) and batch.dtype == torch.float32
        for i, n in enumerate(lengths):
            alone = m(feats[i : i + 1, :n].clone(), torch.tensor([n]))
            torch.testing.assert_close(batch[i, :n], alone[0], rtol=1e-5, atol=1e-5)
            # ... and without lengths (all frames valid), as `transcribe` calls it.
            torch.testing.assert_close(m(feats[i : i + 1, :n].clone())[0], alone[0])
        assert torch.allclose(batch.exp().sum(-1), torch.ones(2, t))  # log-probabilities


def _reachable(dilations: list[int]) -> set[int]:
    offsets = {0}
    for d in dilations:
        offsets = {o + s * d for o in offsets for s in ((-1, 0, 1) if d else (0,))}
    return offsets


@pytest.mark.parametrize("context,layers", [(30, 6), (5, 4), (5, 2), (3, 6), (0, 2), (40, 6), (1, 1)])
def test_dilations_tile_the_whole_window(context, layers):
    d = tdnn_dilations(context, layers)
    assert len(d) == layers
    r = min(context, (3**layers - 1) // 2)  # what `layers` kernel-3 layers can reach without gaps
    assert sum(d) == r
    assert _reachable(d) == set(range(-r, r + 1))  # every frame offset in the window, no holes


def test_output_frame_depends_exactly_on_its_window():
    # Sigmoid (no dead ReLUs) and no norm: every input frame in the window has a non-zero gradient.
    m = _tdnn(activation="sigmoid", norm="none", dropout=0.0, context=5, layers=3)
    r = m.receptive
    assert r == 5
    feats = torch.randn(1, 20, 6, requires_grad=True)
    t = 10
    m(feats)[0, t].sum().backward()
    touched = feats.grad[0].abs().sum(-1).nonzero().flatten().tolist()
    assert touched == list(range(t - r, t + r + 1))
    # At the edge the window is cut and the first frame stands for everything before it.
    feats.grad = None
    m(feats)[0, 1].sum().backward()
    assert feats.grad[0].abs().sum(-1).nonzero().flatten().tolist() == list(range(0, 1 + r + 1))


def test_build_model_picks_the_arch_and_old_configs_are_dnns():
    from mariana.apps.asr.configs import PRESETS

    cfg = dataclasses.asdict(PRESETS["debug"])
    assert isinstance(build_model(cfg, 11), AcousticDNN)  # arch "dnn" (the default)
    old = {k: v for k, v in cfg.items() if k != "arch"}  # model.json written before --arch existed
    assert isinstance(build_model(old, 11), AcousticDNN)
    m = build_model(cfg | {"arch": "tdnn"}, 11)
    assert isinstance(m, AcousticTDNN) and m.out.out_features == 11
    assert m.receptive == min(cfg["context"], (3 ** cfg["layers"] - 1) // 2)
    tdnn = dataclasses.asdict(PRESETS["tdnn"])
    n = sum(p.numel() for p in build_model(tdnn, 11).parameters())
    assert 1e6 < n < 2e6 and build_model(tdnn, 11).receptive == tdnn["context"]


def test_export_and_load_round_trip(tmp_path):
    from mariana.apps.asr.configs import PRESETS
    from mariana.apps.asr.evaluate import load_model
    from mariana.platform.core.export import export_model

    cfg = dataclasses.asdict(PRESETS["debug"]) | {"arch": "tdnn", "norm": "layer"}
    vocab = ["<blank>", "one", "two"]
    torch.manual_seed(0)
    m = build_model(cfg, len(vocab)).eval()
    export_model(tmp_path, m.state_dict(), app="asr", arch="tdnn-ctc", config=cfg, extra={"vocab": vocab})
    loaded, v, c = load_model(tmp_path)
    x = torch.randn(1, 30, cfg["num_mel_bins"])
    assert isinstance(loaded, AcousticTDNN) and v == vocab
    torch.testing.assert_close(loaded(x), m(x))


def test_tdnn_through_the_cli_with_two_workers(data_dir, tmp_path):
    """prepare -> train --arch tdnn --workers 2 (data parallel) -> eval -> transcribe."""
    from mariana.apps.asr.decode import BigramLM

    fsdd = tmp_path / "fsdd"
    fsdd.mkdir()
    for spk in ("george", "lucas", "jackson"):
        for digit in range(10):
            for take in range(2):
                name = f"{digit}_{spk}_{take}.wav"
                (fsdd / name).symlink_to(data_dir / "fsdd/recordings" / name)
    data, run = tmp_path / "data", tmp_path / "run"
    cli_here(
        ["asr", "prepare", "--data", fsdd, "--out", data, "--test-speakers", "jackson"]
        + ["--utterances", "16", "--max-digits", "3"],
        check=True,
    )
    run_cli(
        ["asr", "train", "--data", data, "--out", run, "--preset", "debug", "--arch", "tdnn"]
        + ["--workers", "2", "--no-progress"],
        timeout=300,
        check=True,
    )
    meta = json.loads((run / "model.json").read_text())
    assert meta["arch"] == "tdnn-ctc" and meta["config"]["arch"] == "tdnn"
    # The training transcripts' bigram travels with the model.
    assert meta["lm"] == BigramLM.from_text(data / "train" / "text", meta["vocab"]).to_dict()
    e = cli_here(["asr", "eval", "--model", run, "--data", data / "test", "--beam", "4"], check=True)
    assert last_line(e.stdout).startswith("WER ")
    result = json.loads((run / "eval" / "test.json").read_text())
    assert result["utterances"] == 16 and result["lm_weight"] == 0.0 and result["word_bonus"] == 0.0
    wav = sorted((data / "test" / "wav").glob("*.wav"))[0]
    t = cli_here(["asr", "transcribe", "--model", run, "--beam", "4", wav], check=True)
    assert last_line(t.stdout) == "transcribed 1 of 1 file(s)"
