"""Filterbank features: torchaudio's Kaldi-compatible fbank, per-speaker CMVN, a sharded on-disk cache.

Cache layout (one folder per data dir and feature settings)::

    CACHE/index.json       {"key", "dim", "utts": [{"utt", "spk", "words", "shard", "offset", "frames"}],
                            "skipped": [{"path", "reason"}]}
    CACHE/shard-NNNNN.f16  raw little-endian float16 frames [frames, dim], utterances back to back

An utterance is ``shard[offset : offset + frames]`` (offsets in frames). Features are computed in parallel
worker threads (one chunk of utterances each); unreadable audio is skipped and recorded with its path.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from mariana.platform.cli.console import progress
from mariana.platform.core.atomic import atomic_write_text
from mariana.platform.core.errors import MarianaError

from .cmvn import FilePrior, apply_cmvn, stats
from .data import Utterance, audio_name, read_kaldi_dir, read_wav

INDEX = "index.json"
# Bumped when index.json gains fields (2: speaker_stats), so older caches are rebuilt rather than misread.
CACHE_FORMAT = b"format-2"


@dataclass(frozen=True)
class FeatureSettings:
    """Feature extraction settings (part of the cache key and of the exported model's metadata)."""

    num_mel_bins: int = 40
    sample_rate: int = 8000
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    cmvn: str = "speaker"  # speaker | utterance | file (per file with a FilePrior) | none
    kind: str = "fbank"  # fbank | mfcc
    num_ceps: int = 13  # MFCC only: cepstral coefficients kept

    def key(self, extra: str = "") -> str:
        return hashlib.sha1((json.dumps(asdict(self), sort_keys=True) + extra).encode()).hexdigest()[:12]


def feature_settings(cfg) -> FeatureSettings:
    """The feature settings of a config (an `AsrConfig` or its dict, e.g. an exported model's)."""
    c = asdict(cfg) if not isinstance(cfg, dict) else cfg
    return FeatureSettings(
        num_mel_bins=c["num_mel_bins"],
        sample_rate=c["sample_rate"],
        cmvn=c["cmvn"],
        kind=c.get("features", "fbank"),
        num_ceps=c.get("num_ceps", 13),
    )


def fbank(samples: torch.Tensor, s: FeatureSettings, warp: float = 1.0) -> torch.Tensor:
    """Kaldi features of mono float samples [N] at ``s.sample_rate`` -> [frames, dim]: log mel energies
    (``s.kind == "fbank"``, dim = bins) or MFCCs (``"mfcc"``, dim = ``num_ceps``).

    ``warp`` != 1 warps the mel filters' frequency axis (Kaldi VTLN, piecewise linear between 100 Hz and
    Nyquist - 500 Hz): a vocal tract length change without a tempo change. Samples are scaled to the 16-bit
    integer range first, as Kaldi reads WAVs."""
    import torchaudio

    wav = samples.reshape(1, -1).float() * 32768.0
    common = dict(
        num_mel_bins=s.num_mel_bins,
        sample_frequency=float(s.sample_rate),
        frame_length=s.frame_length_ms,
        frame_shift=s.frame_shift_ms,
        dither=0.0,
        energy_floor=0.0,
        vtln_warp=warp,
    )
    if s.kind == "mfcc":
        return torchaudio.compliance.kaldi.mfcc(wav, num_ceps=s.num_ceps, **common)
    return torchaudio.compliance.kaldi.fbank(wav, **common)


def load_audio(path_or_file, s: FeatureSettings, speed: float = 1.0) -> torch.Tensor:
    """Read a WAV -> mono float samples [N] at ``s.sample_rate``; ``speed`` != 1 is Kaldi-style speed
    perturbation (resample by 1/speed: tempo and pitch change together)."""
    import torchaudio.functional as AF

    x, sr = read_wav(path_or_file)
    need = int(s.sample_rate * s.frame_length_ms / 1000)  # samples of one analysis window at s.sample_rate
    if len(x) * s.sample_rate < need * sr:  # checked before resampling: not one analysis window of audio
        raise MarianaError(
            f"{audio_name(path_or_file)}: audio too short ({len(x)} samples at {sr} Hz = "
            f"{1000 * len(x) / sr:.1f} ms; at least one {s.frame_length_ms:g} ms frame is needed)"
        )
    wav = torch.from_numpy(x)
    if sr != s.sample_rate:
        wav = AF.resample(wav, sr, s.sample_rate)
    if speed != 1.0:
        # Playing s.sample_rate*speed samples per second: resample from sr*speed down to sr.
        wav = AF.resample(wav, int(round(s.sample_rate * speed)), s.sample_rate)
    return wav


def pitch_settings(s: FeatureSettings, pitch: float) -> FeatureSettings:
    """The settings that read audio sped up by ``pitch`` (`load_audio` ``speed``) frame for frame as the
    original: window and shift shortened by the same factor, so each frame covers the same speech."""
    return replace(s, frame_length_ms=s.frame_length_ms / pitch, frame_shift_ms=s.frame_shift_ms / pitch)


# Cepstra of a log-mel frame below this index are its spectral envelope (the vocal tract: what MFCCs keep);
# the rest is the harmonics' ripple across the low filters (the voice's pitch).
ENVELOPE_CEPS = 13


def swap_envelope(
    envelope_of: torch.Tensor, ripple_of: torch.Tensor, keep: int = ENVELOPE_CEPS
) -> torch.Tensor:
    """Log-mel frames [T, bins] with the spectral envelope (first ``keep`` DCT-II cepstra of each frame) of
    ``envelope_of`` [T, bins] and the rest of ``ripple_of`` [T', bins] (cut or edge-padded to T frames)."""
    import scipy.fft

    n = envelope_of.shape[0]
    r = ripple_of[:n]
    if r.shape[0] < n:
        r = torch.cat([r, r[-1:].expand(n - r.shape[0], -1)])
    ce = scipy.fft.dct(envelope_of.double().numpy(), type=2, norm="ortho", axis=1)
    cr = scipy.fft.dct(r.double().numpy(), type=2, norm="ortho", axis=1)
    cr[:, :keep] = ce[:, :keep]
    return torch.from_numpy(scipy.fft.idct(cr, type=2, norm="ortho", axis=1)).to(envelope_of.dtype)


def copy_features(path, s: FeatureSettings, speed: float = 1.0, warp: float = 1.0, pitch: float = 1.0):
    """Raw features [frames, dim] of one perturbed copy of the WAV at ``path`` (see `perturbations`).
    ``pitch`` != 1 changes the pitch alone (filterbanks only): the harmonics of the audio resampled by
    ``pitch`` and framed by `pitch_settings`, with each original frame's envelope (`swap_envelope`)."""
    own = fbank(load_audio(path, s, speed), s, warp)
    if pitch == 1.0:
        return own
    if s.kind != "fbank":
        raise MarianaError(f"pitch perturbation needs filterbank features, not {s.kind}")
    shifted = swap_envelope(own, fbank(load_audio(path, s, speed * pitch), pitch_settings(s, pitch), warp))
    # Lowered audio has nothing above nyquist x pitch: the filters up there keep the original frame.
    top = 0.9 * s.sample_rate / 2 * min(1.0, pitch)
    return torch.where(mel_centres(s) < top, shifted, own)


@functools.lru_cache(maxsize=8)
def mel_centres(s: FeatureSettings) -> torch.Tensor:
    """Centre frequencies (Hz) [bins] of the unwarped Kaldi mel filters of ``s`` (as `fbank` makes them)."""
    from torchaudio.compliance.kaldi import get_mel_banks

    # Only the centres are used; they do not depend on the FFT size or the VTLN cut-offs.
    _, centres = get_mel_banks(s.num_mel_bins, 512, float(s.sample_rate), 20.0, 0.0, 100.0, -500.0, 1.0)
    return centres.reshape(-1).float()


def _chunk_worker(args) -> tuple[list[tuple[int, np.ndarray]], list[tuple[int, str]]]:
    """Compute raw features for ``[(index, path, speed, warp, pitch)]`` in a worker thread."""
    items, settings = args
    s = FeatureSettings(**settings)
    done, failed = [], []
    for i, path, speed, warp, pitch in items:
        try:
            feats = copy_features(path, s, speed, warp, pitch)
            if feats.shape[0] == 0:
                raise MarianaError(f"{path}: shorter than one frame")
            done.append((i, feats.numpy().astype(np.float32)))
        except MarianaError as e:
            failed.append((i, str(e)))
        except Exception as e:  # a decoder or resampler failing on strange input must not stop the job
            failed.append((i, f"{path}: {type(e).__name__}: {e}"))
    return done, failed


def compute_raw(
    jobs_in: list[tuple[str, float, float, float]], s: FeatureSettings, jobs: int = 2
) -> tuple[dict[int, np.ndarray], dict[int, str]]:
    """Raw features for each ``(path, speed, warp, pitch)`` in parallel -> ({index: [frames, dim]},
    {index: reason})."""
    items = [(i, *w) for i, w in enumerate(jobs_in)]
    jobs = max(1, min(jobs, len(items)))
    # chunks of 64 recordings: the threads stay busy to the end and `progress` can count them
    args = [(items[k : k + 64], asdict(s)) for k in range(0, len(items), 64)]
    feats: dict[int, np.ndarray] = {}
    failed: dict[int, str] = {}
    # Threads, not processes: libsndfile decoding and torch kernels release the GIL, and a worker
    # thread starts in microseconds where a spawned process re-imports torch (seconds per job).
    # One job computes in this thread, as before (thread-local torch settings such as flush-denormal).
    with cf.ThreadPoolExecutor(jobs) as ex:
        done = map(_chunk_worker, args) if jobs == 1 else ex.map(_chunk_worker, args)
        results = list(progress(done, len(args), "computing features", "chunks of 64 recordings"))
    for done, bad in results:
        feats.update(done)
        failed.update(bad)
    return feats, failed


ORIGINAL = [(1.0, 1.0, 1.0)]  # the (speed, VTLN warp, pitch) copies of an utterance: the original only


def perturbations(
    speeds: tuple[float, ...] = (1.0,), warps: tuple[float, ...] = (1.0,), pitches: tuple[float, ...] = ()
) -> list[tuple[float, float, float]]:
    """The (speed, VTLN warp, pitch) copies made of each utterance: every speed unwarped, then every warp and
    then every pitch factor at the original speed (a sum, not a product, so the copies grow linearly with
    the factors)."""
    out = [(sp, 1.0, 1.0) for sp in speeds]
    out += [(1.0, w, 1.0) for w in warps if (1.0, w, 1.0) not in out]
    out += [(1.0, 1.0, p) for p in pitches if (1.0, 1.0, p) not in out]
    return out


def copy_tag(speed: float = 1.0, warp: float = 1.0, pitch: float = 1.0) -> str:
    """The prefix of the ids and speakers of a perturbed copy (`perturbations`): ``sp{speed}-``,
    ``vtln{warp}-``, ``pitch{pitch}-``, or "" for the original audio."""
    if pitch != 1.0:
        return f"pitch{pitch}-"
    return "" if (speed, warp) == (1.0, 1.0) else (f"sp{speed}-" if warp == 1.0 else f"vtln{warp}-")


def extract(
    utts: list[Utterance],
    s: FeatureSettings,
    jobs: int = 2,
    copies: list[tuple[float, float, float]] = ORIGINAL,
    prior: FilePrior | None = None,
) -> tuple[list[Utterance], list[np.ndarray], list[tuple[str, str]], dict[str, dict]]:
    """Features of ``utts`` (x each of the (speed, warp, pitch) ``copies``, e.g. `perturbations`), CMVN
    applied -> (kept utterances, [frames, dim] float32 arrays, skipped [(path, reason)], raw-feature
    statistics of each speaker's unperturbed audio ``{spk: {"sum", "sumsq", "frames"}}``). Perturbed copies' ids and speakers are prefixed `copy_tag`
    (separate CMVN statistics, as in Kaldi recipes). ``s.cmvn == "file"`` normalises each utterance alone
    with ``prior`` (default: the prior of these utterances' own speakers, as for a training set)."""
    work, meta = [], []
    for sp, w, p in copies:
        tag = copy_tag(sp, w, p)
        for u in utts:
            work.append((u.path, sp, w, p))
            meta.append(Utterance(f"{tag}{u.utt}", f"{tag}{u.spk}", u.words, u.path) if tag else u)
    raw, failed = compute_raw(work, s, jobs)
    kept = [i for i in range(len(work)) if i in raw]
    skipped = [(work[i][0], failed[i]) for i in sorted(failed) if work[i][1:] == (1.0, 1.0, 1.0)]
    out_utts = [meta[i] for i in kept]
    feats = [raw[i] for i in kept]
    spk_stats: dict[str, dict] = {}
    for i in kept:
        if work[i][1:] == (1.0, 1.0, 1.0):
            s1, s2, n = stats(raw[i])
            acc = spk_stats.setdefault(meta[i].spk, {"sum": 0.0, "sumsq": 0.0, "frames": 0})
            acc["sum"], acc["sumsq"], acc["frames"] = acc["sum"] + s1, acc["sumsq"] + s2, acc["frames"] + n
    spk_stats = {
        k: {"sum": v["sum"].tolist(), "sumsq": v["sumsq"].tolist(), "frames": v["frames"]}
        for k, v in spk_stats.items()
    }
    if s.cmvn == "file":
        if prior is None:
            if not spk_stats:
                raise MarianaError("no readable utterances to compute the CMVN prior from")
            prior = FilePrior.from_speaker_stats(spk_stats)
        feats = [prior.apply(f) for f in feats]
    elif s.cmvn != "none":
        groups = [u.spk if s.cmvn == "speaker" else u.utt for u in out_utts]
        feats = apply_cmvn(feats, groups)
    return out_utts, feats, skipped, spk_stats


class FeatureCache:
    """Read side of the sharded fp16 cache: ``len``, ``feats(i) -> float32 tensor [frames, dim]``,
    ``utts`` (id, spk, words, frames), ``skipped``, ``speaker_stats`` (raw-feature statistics per speaker,
    see `extract`)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = json.loads((self.folder / INDEX).read_text())
        self.key, self.dim, self.utts, self.skipped = (index[k] for k in ("key", "dim", "utts", "skipped"))
        self.speaker_stats: dict[str, dict] = index.get("speaker_stats", {})
        self._shards: dict[int, np.ndarray] = {}
        self.lengths = [u["frames"] for u in self.utts]

    def prior(self, cmvn: str) -> FilePrior | None:
        """With ``cmvn`` "file": these (training) speakers' statistics, the prior every other set is
        normalised with; else None."""
        return FilePrior.from_speaker_stats(self.speaker_stats) if cmvn == "file" else None

    def __len__(self) -> int:
        return len(self.utts)

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._shards:
            path = self.folder / f"shard-{k:05d}.f16"
            self._shards[k] = np.memmap(path, dtype="<f2", mode="r").reshape(-1, self.dim)
        return self._shards[k]

    def feats(self, i: int) -> torch.Tensor:
        u = self.utts[i]
        a = self._shard(u["shard"])[u["offset"] : u["offset"] + u["frames"]]
        return torch.from_numpy(np.asarray(a, dtype=np.float32))


class UtteranceSet(torch.utils.data.Dataset):
    """Cached utterances as (feats [T, bins] float32, target unit ids [L] int64), for training and decoding."""

    def __init__(self, cache: FeatureCache, vocab: list[str]):
        self.cache = cache
        self.unit = {w: i for i, w in enumerate(vocab)}
        self.lengths = cache.lengths

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int):
        words = self.cache.utts[i]["words"]
        return self.cache.feats(i), torch.tensor([self.unit.get(w, 0) for w in words], dtype=torch.long)


def collate(items) -> dict[str, torch.Tensor]:
    """[(feats [T_i, F], targets [L_i])] -> padded feats [B, T, F], lengths [B], targets [sum L],
    target_lengths [B]."""
    feats = torch.nn.utils.rnn.pad_sequence([f for f, _ in items], batch_first=True)
    return {
        "feats": feats,
        "lengths": torch.tensor([len(f) for f, _ in items]),
        "targets": torch.cat([t for _, t in items]),
        "target_lengths": torch.tensor([len(t) for _, t in items]),
    }


def write_cache(
    folder: Path,
    key: str,
    utts: list[Utterance],
    feats: list[np.ndarray],
    skipped: list[tuple[str, str]],
    shard_frames: int = 1 << 20,
    speaker_stats: dict[str, dict] | None = None,
) -> None:
    """Write shards (about ``shard_frames`` frames each) and then the index (written last, atomically:
    a cache without index.json is incomplete and is rebuilt)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)
    dim = feats[0].shape[1] if feats else 0
    entries, shard, offset, buf = [], 0, 0, []

    def flush():
        nonlocal shard, offset, buf
        if buf:
            np.concatenate(buf).astype("<f2").tofile(folder / f"shard-{shard:05d}.f16")
            shard, offset, buf = shard + 1, 0, []

    for u, f in zip(utts, feats):
        entries.append(
            {"utt": u.utt, "spk": u.spk, "words": u.words, "shard": shard, "offset": offset, "frames": len(f)}
        )
        buf.append(f)
        offset += len(f)
        if offset >= shard_frames:
            flush()
    flush()
    index = {
        "key": key,
        "dim": dim,
        "utts": entries,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
        "speaker_stats": speaker_stats or {},
    }
    atomic_write_text(folder / INDEX, json.dumps(index) + "\n")


def cached_features(
    data_dir: str | Path,
    s: FeatureSettings,
    jobs: int = 2,
    copies: list[tuple[float, float, float]] = ORIGINAL,
    cache_root: str | Path | None = None,
    prior: FilePrior | None = None,
) -> FeatureCache:
    """The feature cache of a Kaldi data dir, built if missing or stale (settings or wav.scp changed).

    ``copies``: the (speed, warp, pitch) copies of each utterance (`perturbations`). The cache lives in
    ``cache_root/<key>`` (default ``DATA_DIR/feats/<key>``). ``prior``: the per-file CMVN prior of
    ``s.cmvn == "file"`` (part of the key)."""
    data_dir = Path(data_dir)
    scp = data_dir / "wav.scp"
    if not scp.is_file():
        raise MarianaError(f"{data_dir}: no wav.scp (run `mariana asr prepare` first)")
    stamp = hashlib.sha1(
        scp.read_bytes()
        + (data_dir / "text").read_bytes()
        + repr(list(copies)).encode()
        + (prior.digest().encode() if s.cmvn == "file" and prior else b"")
        + CACHE_FORMAT
    ).hexdigest()
    key = s.key(stamp)
    folder = Path(cache_root or data_dir / "feats") / key
    if (folder / INDEX).is_file():
        cache = FeatureCache(folder)
        if cache.key == key:
            return cache
    utts, feats, skipped, spk_stats = extract(read_kaldi_dir(data_dir), s, jobs, copies, prior)
    write_cache(folder, key, utts, feats, skipped, speaker_stats=spk_stats)
    return FeatureCache(folder)
