"""Config of ``mariana asr train``: the platform's training sections (ASR's own defaults for the loop and
the optimizer) plus the sections of the features, the acoustic model, the training-data augmentation and
the decoding; presets ``debug``, ``small``, ``tdnn``, ``mariana``. Standard library only (the parser
module imports it under ``mariana asr --help``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from mariana.platform.core.config import (
    RESUME_MAY_CHANGE,
    WITHOUT_MAX_STEPS,
    DataParallelSection,
    DataSection,
    LaunchSection,
    LoopSection,
    OptimSection,
    RunSection,
    Section,
    TrainJob,
    at_least,
    at_least_one,
    given,
    non_negative,
    only,
    opt,
    when,
)
from mariana.platform.core.config.fields import Clause
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.tracking import TrackingSection


def has_dev_set(cfg) -> bool:
    """Whether the prepared folder --data has a dev set (a non-empty DATA/dev/wav.scp): two ``stat`` calls.
    A folder without DATA/train (not prepared, or on another host at submit) is left to the run to judge."""
    data, scp = Path(cfg.data), Path(cfg.data) / "dev" / "wav.scp"
    return not (data / "train").is_dir() or (scp.is_file() and scp.stat().st_size > 0)


@dataclass
class AsrInput(DataSection):
    """A Kaldi data dir (DATA/train, DATA/dev) and where its features are cached."""

    data: str = opt("", "prepared data folder with train/ (and dev/) Kaldi data dirs", path=True)
    feature_jobs: int = opt(2, "parallel threads computing features into the cache")
    cache: str = opt("", "feature cache folder (default: DATA/<split>/feats/)", path=True)
    cache_gb: float = opt(
        4.0,
        "host RAM the training features may take: a cache that fits the GPU (a quarter of its free memory) "
        "goes there, else into RAM up to this many GB, else it is read from disk by loader workers",
    )

    def validate(self) -> None:
        non_negative(self, ("cache_gb",))
        at_least_one(self, ("feature_jobs",))


@dataclass
class AsrLoop(LoopSection):
    epochs: int = opt(6, "passes over the training data", applies=WITHOUT_MAX_STEPS)
    log_every: int = opt(20, "optimizer steps between metrics.jsonl records")


@dataclass
class AsrOptim(OptimSection):
    # The defaults are the best measured recipe (apps/asr/README.md, "Unseen speakers").
    batch_size: int = opt(
        8, "utterances per worker per micro-step (global batch = workers x this x grad-accum)"
    )
    lr: float = opt(3e-3, "peak learning rate")
    schedule: str = opt("cosine", "learning-rate schedule after warm-up", ["constant", "cosine", "linear"])
    warmup_steps: int = opt(20, "linear warm-up steps")
    clip_grad: float = opt(5.0, "clip the global gradient norm to this value; 0 disables")


@dataclass
class AsrFeatures(Section):
    """Frame features (torchaudio's Kaldi-compatible fbank/MFCC) and their normalisation."""

    NAME: ClassVar[str] = "feats"
    TITLE: ClassVar[str] = "frame features"

    num_mel_bins: int = opt(40, "mel filterbank bins (torchaudio Kaldi-compatible fbank)")
    features: str = opt(
        "fbank", "frame features: log mel filterbank or MFCC (Kaldi-compatible)", ["fbank", "mfcc"]
    )
    num_ceps: int = opt(13, "MFCC coefficients per frame", applies=only("features", "mfcc"))
    sample_rate: int = opt(8000, "audio sample rate in Hz (other rates are resampled)")
    cmvn: str = opt(
        "speaker",
        "mean/variance normalisation statistics: per speaker, per utterance, or per file with the "
        "training speakers' statistics as prior (what `transcribe` does with a speaker model)",
        ["speaker", "utterance", "file", "none"],
    )

    def validate(self) -> None:
        at_least_one(self, ("num_mel_bins",))
        if self.features == "mfcc" and not 1 <= self.num_ceps <= self.num_mel_bins:
            raise MarianaError(f"--num-ceps must be in [1, --num-mel-bins], got {self.num_ceps}")
        if self.sample_rate < 1000:
            raise MarianaError(f"--sample-rate must be at least 1000 Hz, got {self.sample_rate}")


@dataclass
class AsrModel(Section):
    """The acoustic network (CTC over the digit words) and how it is compiled."""

    NAME: ClassVar[str] = "acoustic"
    TITLE: ClassVar[str] = "acoustic model"

    arch: str = opt(
        "dnn",
        "acoustic model: 'dnn' = spliced frames into fully connected layers; 'tdnn' = dilated 1-D "
        "convolutions over frames (Kaldi TDNN) whose receptive field is +-context frames",
        ["dnn", "tdnn"],
    )
    context: int = opt(
        30, "frames spliced on each side of the centre frame (input = (2c+1) x bins); tdnn: receptive field"
    )
    hidden: int = opt(384, "hidden layer width")
    layers: int = opt(3, "hidden layers")
    output_units: int = opt(0, "output layer width; 0 = vocabulary + blank (larger = 'wide' output)")
    activation: str = opt("relu", "hidden activation", ["relu", "sigmoid"])
    dropout: float = opt(0.1, "dropout after each hidden layer")
    norm: str = opt("layer", "normalisation after each hidden linear layer", ["none", "layer"])
    compile: bool | None = opt(
        None,
        "torch.compile the model (longer start-up, paid once per model with the compile cache; faster steps: "
        "frames are bucketed); default: on a GPU, where the small recipe's step is launch-bound, off on the CPU",
    )
    compile_backend: str = opt(
        "inductor",
        "torch.compile backend (aot_eager compiles in seconds, for tests)",
        ["inductor", "aot_eager"],
        applies=when(
            "compile", lambda cfg: cfg.compile is not False, "runs unless --no-compile", True, False
        ),
    )

    def validate(self) -> None:
        if self.context < 0 or self.hidden < 1 or self.layers < 1:
            raise MarianaError("--context >= 0, --hidden >= 1, --layers >= 1 are required")
        if not 0 <= self.dropout < 1:
            raise MarianaError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.output_units < 0:
            raise MarianaError(
                f"--output-units must be >= 0 (0 = vocabulary + blank), got {self.output_units}"
            )


def _stretching(cfg) -> bool:
    """--time-stretch other than 1,1 (the on-the-fly tempo change is on)."""
    return list(cfg.time_stretch) != [1.0, 1.0]


@dataclass
class AsrAugment(Section):
    """Copies of the training audio (speed, VTLN, pitch) and on-the-fly tempo and SpecAugment masks."""

    NAME: ClassVar[str] = "augment"
    TITLE: ClassVar[str] = "training-data augmentation"

    speed_perturb: list[float] = opt(
        [0.8, 0.9, 1.0, 1.1, 1.2], "speed factors of the training copies, e.g. 0.9,1.0,1.1"
    )
    vtln_perturb: list[float] = opt(
        [1.0], "VTLN warp factors of extra training copies (frequency axis only), e.g. 0.9,1.1"
    )
    pitch_perturb: list[float] = opt(
        [1.0],
        "pitch factors of extra training copies (pitch only: formants and tempo kept), e.g. 0.9,1.1",
        applies=only("features", "fbank"),
    )
    time_stretch: list[float] = opt(
        [1.0, 1.0], "tempo factor range LO,HI drawn per segment on the fly (frame axis only), e.g. 0.7,1.4"
    )
    stretch_segment: int = opt(
        0,
        "input frames per independently stretched run; 0 = whole utterance",
        applies=when("time_stretch", _stretching, "a --time-stretch other than 1,1", [0.8, 1.2], [1.0, 1.0]),
    )
    spec_augment: bool = opt(True, "SpecAugment-style frequency and time masking (torchaudio)")
    freq_mask: int = opt(8, "SpecAugment: widest frequency mask (bins)", applies=given("spec_augment"))
    time_mask: int = opt(10, "SpecAugment: widest time mask (frames)", applies=given("spec_augment"))
    num_masks: int = opt(2, "SpecAugment: masks of each kind per utterance", applies=given("spec_augment"))

    def validate(self) -> None:
        for flag, factors, lo, hi in (
            ("--speed-perturb", self.speed_perturb, 0.5, 2.0),
            ("--vtln-perturb", self.vtln_perturb, 0.7, 1.3),
            ("--pitch-perturb", self.pitch_perturb, 0.7, 1.3),
        ):
            if not factors or any(not lo <= f <= hi for f in factors):
                raise MarianaError(f"{flag} factors must be in [{lo:g}, {hi:g}], got {factors}")
        if len(self.time_stretch) != 2 or not 0.3 <= self.time_stretch[0] <= self.time_stretch[1] <= 3.0:
            raise MarianaError(
                f"--time-stretch must be LO,HI with 0.3 <= LO <= HI <= 3, got {self.time_stretch}"
            )
        non_negative(self, ("stretch_segment",))
        if min(self.freq_mask, self.time_mask, self.num_masks) < 0:
            raise MarianaError("--freq-mask, --time-mask and --num-masks must be >= 0")


def check_decode(beam: int | None, lm_weight: float | None) -> None:
    """MarianaError for a negative --beam or --lm-weight (None: not given)."""
    if beam is not None and beam < 0:
        raise MarianaError(f"--beam must be >= 0 (0 = greedy), got {beam}")
    if lm_weight is not None and lm_weight < 0:
        raise MarianaError(f"--lm-weight must be >= 0 (0 = no language model), got {lm_weight}")


@dataclass
class AsrDecode(Section):
    """How the dev set is decoded during training (and the run's defaults for eval, transcribe, serve)."""

    NAME: ClassVar[str] = "decode"
    TITLE: ClassVar[str] = "decoding"

    beam: int = opt(8, "CTC prefix beam width for evaluation; 0 = greedy")
    lm_weight: float = opt(
        0.0,
        "weight of the training transcripts' word bigram (the digit-loop grammar) in the prefix beam "
        "search (shallow fusion); 0 = acoustics only",
        applies=at_least("beam", 1),
    )
    word_bonus: float = opt(
        0.0,
        "log-score added per emitted word in the prefix beam search (> 0 counters deletions)",
        applies=at_least("beam", 1),
    )

    def validate(self) -> None:
        check_decode(self.beam, self.lm_weight)
        if (self.lm_weight or self.word_bonus) and self.beam == 0:  # e.g. from a preset
            raise MarianaError("--lm-weight and --word-bonus act in the prefix beam search: set --beam >= 1")


ASR_SECTIONS = (
    RunSection,
    AsrInput,
    LaunchSection,
    DataParallelSection,
    AsrLoop,
    AsrOptim,
    AsrFeatures,
    AsrModel,
    AsrAugment,
    AsrDecode,
    TrackingSection,
)


class AsrConfig(TrainJob, sections=ASR_SECTIONS):
    """``mariana asr train``."""

    RESUME_MAY_CHANGE: ClassVar[frozenset[str]] = RESUME_MAY_CHANGE | {
        "cache_gb",
        "compile",
        "compile_backend",
    }
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("wer", "ser")
    VALIDATION: ClassVar[tuple] = (
        Clause("data", has_dev_set, "a --data with a dev set (DATA/dev/wav.scp)",
               ("train/wav.scp", "dev/wav.scp"), ("train/wav.scp",), layout=True),
    )  # fmt: skip

    def check(self) -> None:
        super().check()
        if self.features == "mfcc" and any(p != 1.0 for p in self.pitch_perturb):  # e.g. from a preset
            raise MarianaError(
                "--pitch-perturb needs --features fbank: its copies change the harmonics' ripple across the "
                "filters, which the first cepstra of MFCCs leave out"
            )


# The settings the defaults had before they became the `small` recipe: the debug and mariana presets keep them.
_PLAIN = dict(
    context=5,
    hidden=512,
    layers=4,
    norm="none",
    dropout=0.0,
    speed_perturb=[1.0],
    spec_augment=False,
    beam=0,
    epochs=1,
    batch_size=64,
    lr=1e-3,
    schedule="constant",
    warmup_steps=0,
    clip_grad=0.0,
    log_every=10,
)

PRESETS = {
    "debug": AsrConfig(**{**_PLAIN, "hidden": 64, "layers": 2, "batch_size": 8, "log_every": 5, "lr": 2e-3}),
    # The default recipe: a +-30 frame window (0.6 s; digits are words), 1.2M parameters; speed perturbation,
    # LayerNorm and dropout carry it to an unseen speaker (numbers: apps/asr/README.md).
    "small": AsrConfig(),
    # "small" with a TDNN (same receptive field, 1.3M parameters); it stays on the CTC blank plateau far
    # longer than the DNN (apps/asr/README.md), so it is an option, not the default.
    "tdnn": AsrConfig(arch="tdnn", hidden=288, layers=6),
    # The classic Mariana DNN: 440 -> 7 x 2048 -> 12000 outputs, about 50.7M parameters (GPU benchmark).
    "mariana": AsrConfig(
        **{
            **_PLAIN,
            "hidden": 2048,
            "layers": 7,
            "output_units": 12000,
            "batch_size": 32,
            "epochs": 10,
            "schedule": "cosine",
            "warmup_steps": 50,
            "clip_grad": 5.0,
            "spec_augment": True,
        }
    ),
}
