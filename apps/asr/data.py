"""Connected-digit data preparation and Kaldi-style data directories: ``prepare`` reads an FSDD-style folder
(``{digit}_{speaker}_{take}.wav``; 1..max_digits recordings of one speaker joined by 50-300 ms pauses of
low-level noise) or a Kaldi data dir, splits it by speaker and writes ``OUT/{train,dev,test}/`` data dirs.
"""

from __future__ import annotations

import io
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
from mariana.platform.core.errors import DataError, MarianaError

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FSDD_NAME = re.compile(r"^(\d)_([A-Za-z0-9-]+)_(\d+)\.wav$")
SPLITS = ("train", "dev", "test")


@dataclass
class Utterance:
    """One Kaldi utterance: id, speaker, transcript words, audio file path."""

    utt: str
    spk: str
    words: list[str]
    path: str


@dataclass
class PrepareReport:
    counts: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def audio_name(path: str | Path | io.IOBase) -> str:
    """How messages name an audio source: its path, or "uploaded audio" for an in-memory upload."""
    return "uploaded audio" if isinstance(path, io.IOBase) else str(path)


def _riff_data_shortfall(f) -> tuple[int, int] | None:
    """For a RIFF/WAVE stream whose ``data`` chunk is cut short: (bytes its header declares, bytes present);
    None for a complete file, a streamed one (size 0 or 0xFFFFFFFF: unknown when it was written) or
    another format (left to the decoder)."""
    f.seek(0, io.SEEK_END)
    total = f.tell()
    f.seek(0)
    head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    off = 12
    while off + 8 <= total:
        f.seek(off)
        chunk = f.read(8)
        size = int.from_bytes(chunk[4:8], "little")
        if chunk[:4] == b"data":
            present = total - off - 8
            if size not in (0, 0xFFFFFFFF) and present < size:
                return size, present
            return None
        off += 8 + size + (size & 1)
    return None


AUDIO_FORMATS = "WAV/FLAC/OGG"  # what soundfile decodes here: transcribe, eval and the REST route alike


def read_wav(path: str | Path | io.BytesIO) -> tuple[np.ndarray, int]:
    """Read a WAV file as mono float32 samples in [-1, 1] -> (samples [N], sample rate Hz).

    Raises MarianaError naming the file when it is missing, cannot be decoded, is a WAV whose audio is cut
    short of what its header declares (a truncated copy: never used as data), or holds no samples."""
    # An in-memory upload (serving) is named as such rather than by its object repr.
    name = audio_name(path)
    if not isinstance(path, io.IOBase) and not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "no such file"
        raise MarianaError(f"{name}: {what} (expected a WAV file)")
    try:
        if isinstance(path, io.IOBase):
            short = _riff_data_shortfall(path)
            path.seek(0)
        else:
            with open(path, "rb") as f:
                short = _riff_data_shortfall(f)
    except OSError as e:
        raise MarianaError(f"{name}: cannot read ({e.strerror or e})") from None
    if short:
        raise MarianaError(
            f"{name}: truncated WAV file: its header declares {short[0]} bytes of audio, the file holds "
            f"{short[1]}"
        )
    try:
        data, sr = sf.read(path, dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError on bad input
        reason = str(e).replace(repr(path), "").strip(": ")
        reason = reason.removeprefix("Error opening").strip(": ") or type(e).__name__
        raise MarianaError(f"{name}: unreadable audio, expected a {AUDIO_FORMATS} file ({reason})") from None
    if data.shape[0] == 0:
        raise MarianaError(f"{name}: audio has no samples")
    return data.mean(axis=1).astype(np.float32), int(sr)


def write_wav(path: Path, samples: np.ndarray, sr: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), np.clip(samples, -1.0, 1.0), sr, subtype="PCM_16")


# --- Kaldi data dirs --------------------------------------------------------------------------------------
def _read_table(path: Path, required: bool = True) -> list[tuple[int, str, str]]:
    """Lines ``key rest`` of a Kaldi table -> [(line number, key, rest)]."""
    if not path.is_file():
        if required:
            raise DataError(f"{path}: missing (a Kaldi data dir needs wav.scp, text and utt2spk)")
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.strip().split(maxsplit=1)
        rows.append((n, parts[0], parts[1] if len(parts) > 1 else ""))
    return rows


def read_kaldi_dir(d: str | Path) -> list[Utterance]:
    """Read a Kaldi data dir (``wav.scp`` with plain file paths, ``text``, ``utt2spk``) -> utterances.

    Relative paths in ``wav.scp`` are taken relative to the directory. Piped entries (``cmd |``) and
    utterances missing from ``text``/``utt2spk`` raise MarianaError naming the file and line."""
    d = Path(d)
    if not d.is_dir():
        raise DataError(f"{d}: no such directory")
    wavs = _read_table(d / "wav.scp")
    texts = {k: v for _, k, v in _read_table(d / "text")}
    spks = {k: v for _, k, v in _read_table(d / "utt2spk")}
    utts = []
    for n, key, rest in wavs:
        if rest.endswith("|") or rest.startswith("|") or " |" in rest:
            raise DataError(
                f"{d / 'wav.scp'} line {n}: piped entry {rest!r} is not supported; "
                "expected a WAV file path (run the command once and point wav.scp at the file)"
            )
        if not rest:
            raise DataError(f"{d / 'wav.scp'} line {n}: expected '<utt-id> <wav path>', got {key!r}")
        if key not in texts:
            raise DataError(f"{d / 'text'}: no transcript for utterance {key!r} (wav.scp line {n})")
        if key not in spks:
            raise DataError(f"{d / 'utt2spk'}: no speaker for utterance {key!r} (wav.scp line {n})")
        path = Path(rest)
        if not path.is_absolute():
            path = d / path
        utts.append(Utterance(key, spks[key], texts[key].split(), str(path)))
    return utts


def write_kaldi_dir(d: Path, utts: list[Utterance]) -> None:
    """Write ``wav.scp``, ``text``, ``utt2spk``, ``spk2utt`` (sorted by utterance id, as Kaldi wants)."""
    d.mkdir(parents=True, exist_ok=True)
    utts = sorted(utts, key=lambda u: u.utt)
    (d / "wav.scp").write_text("".join(f"{u.utt} {u.path}\n" for u in utts))
    (d / "text").write_text("".join(f"{u.utt} {' '.join(u.words)}\n" for u in utts))
    (d / "utt2spk").write_text("".join(f"{u.utt} {u.spk}\n" for u in utts))
    spk2utt: dict[str, list[str]] = {}
    for u in utts:
        spk2utt.setdefault(u.spk, []).append(u.utt)
    (d / "spk2utt").write_text("".join(f"{s} {' '.join(us)}\n" for s, us in sorted(spk2utt.items())))


# --- FSDD -> connected digits --------------------------------------------------------------------------
def scan_fsdd(folder: Path) -> dict[str, list[tuple[int, Path]]]:
    """``{speaker: [(digit, path), ...]}`` for files named ``{digit}_{speaker}_{take}.wav``."""
    by_spk: dict[str, list[tuple[int, Path]]] = {}
    for p in sorted(folder.iterdir()):
        m = FSDD_NAME.match(p.name)
        if m:
            by_spk.setdefault(m.group(2), []).append((int(m.group(1)), p))
    return by_spk


def _pause(rng: np.random.Generator, sr: int, level: float) -> np.ndarray:
    """50-300 ms of low-level Gaussian noise (not digital silence, which no microphone records)."""
    n = int(sr * rng.uniform(0.05, 0.30))
    return (rng.standard_normal(n) * level).astype(np.float32)


def build_connected(
    recordings: list[tuple[int, np.ndarray]], sr: int, n_utts: int, max_digits: int, rng: np.random.Generator
) -> list[tuple[list[int], np.ndarray]]:
    """Join one speaker's isolated digits into ``n_utts`` utterances of 1..max_digits digits.

    Recordings are drawn without replacement from a shuffled list (reshuffled when exhausted), so every
    recording is used before any repeats. Returns [(digits, samples)]."""
    order: list[int] = []
    out = []
    # The noise level follows the speaker's recording level: about -50 dB under the typical speech RMS.
    rms = float(np.median([np.sqrt(np.mean(x**2)) + 1e-8 for _, x in recordings]))
    level = rms * 10 ** (-50 / 20)
    for _ in range(n_utts):
        k = int(rng.integers(1, max_digits + 1))
        digits, parts = [], [_pause(rng, sr, level)]
        for _ in range(k):
            if not order:
                order = list(rng.permutation(len(recordings)))
            d, x = recordings[order.pop()]
            digits.append(d)
            parts += [x, _pause(rng, sr, level)]
        out.append((digits, np.concatenate(parts)))
    return out


def _split_speakers(
    speakers: list[str], test: list[str], dev: list[str], need_train: bool = True
) -> dict[str, str]:
    """``{speaker: split}``. ``need_train``: at least one speaker must be left for the training set (an
    FSDD corpus is prepared to train on; a Kaldi data dir may be converted into a test-only set)."""
    unknown = [s for s in test + dev if s not in speakers]
    if unknown:
        raise MarianaError(
            f"speaker(s) {', '.join(unknown)} not found in the data (speakers: {', '.join(speakers)})"
        )
    both = set(test) & set(dev)
    if both:
        raise MarianaError(f"speaker(s) {', '.join(sorted(both))} given as both test and dev speakers")
    split_of = {s: "test" if s in test else "dev" if s in dev else "train" for s in speakers}
    if need_train and "train" not in split_of.values():
        raise MarianaError(
            f"--test-speakers/--dev-speakers name every speaker in the data ({', '.join(speakers)}): "
            "no speaker is left for the training set; hold out fewer speakers"
        )
    return split_of


def check_out_dir(out: Path) -> None:
    """``--out`` must be a folder that can be created and written: one clear line otherwise."""
    if out.exists() and not out.is_dir():
        raise MarianaError(f"--out {out}: exists and is not a folder (expected an output folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mariana-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise MarianaError(f"--out {out}: cannot write there ({e.strerror or e})") from None


def _check_prepare_args(
    data: Path, out: Path, utterances: int, max_digits: int, seed: int, synth_ratio: float
):
    """`DataError`/`MarianaError` for a missing --data, bad counts, or an --out that is --data or unwritable."""
    if not data.exists():
        raise DataError(f"--data {data}: no such file or directory")
    if not data.is_dir():
        raise DataError(f"--data {data}: expected a folder of FSDD WAVs or a Kaldi data dir")
    if max_digits < 1 or utterances < 1:
        raise MarianaError(f"--max-digits and --utterances must be >= 1, got {max_digits} and {utterances}")
    if seed < 0:
        raise MarianaError(f"--seed must be >= 0, got {seed}")
    if synth_ratio < 0:
        raise MarianaError(f"--synth-ratio must be >= 0, got {synth_ratio}")
    if out.resolve() == data.resolve():
        raise MarianaError(f"--out {out}: is the --data folder; choose a separate output folder")
    check_out_dir(out)


def _from_kaldi_dir(
    data: Path, out: Path, test_speakers: list[str], dev_speakers: list[str], report: PrepareReport
):
    """Split a Kaldi data dir's utterances by speaker, copying each readable WAV to ``out/SPLIT/wav`` ->
    {split: [Utterance]} (unreadable ones in ``report.skipped``)."""
    result: dict[str, list[Utterance]] = {s: [] for s in SPLITS}
    utts = read_kaldi_dir(data)
    speakers = sorted({u.spk for u in utts})
    if not test_speakers:
        test_speakers = speakers[-1:]
    split_of = _split_speakers(speakers, test_speakers, dev_speakers, need_train=False)
    for u in utts:
        try:
            read_wav(u.path)
        except MarianaError as e:
            report.skipped.append((u.path, str(e)))
            continue
        split = split_of[u.spk]
        dst = out / split / "wav" / f"{u.utt}.wav"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(u.path, dst)
        result[split].append(Utterance(u.utt, u.spk, u.words, str(dst.resolve())))
    return result


def _read_speaker(recordings: list[tuple[int, Path]], report: PrepareReport):
    """One speaker's readable recordings at its first file's sample rate -> ([(digit, samples)], rate);
    the others go to ``report.skipped``."""
    recs, sr = [], None
    for digit, path in recordings:
        try:
            x, r = read_wav(path)
        except MarianaError as e:
            report.skipped.append((str(path), str(e)))
            continue
        if sr is not None and r != sr:
            report.skipped.append((str(path), f"{path}: sample rate {r} Hz, speaker uses {sr} Hz"))
            continue
        sr = r
        recs.append((digit, x))
    return recs, sr


def _from_fsdd(data: Path, out: Path, test_speakers: list[str], dev_speakers: list[str], utterances: int,
               max_digits: int, rng, synth, synth_ratio: float, report: PrepareReport):  # fmt: skip
    """``utterances`` connected-digit utterances per FSDD speaker (and the --synth speakers' share of the
    training split), written to ``out/SPLIT/wav`` -> {split: [Utterance]}."""
    result: dict[str, list[Utterance]] = {s: [] for s in SPLITS}
    by_spk = scan_fsdd(data)
    if not by_spk:
        raise DataError(
            f"--data {data}: no '{{digit}}_{{speaker}}_{{take}}.wav' files and no wav.scp "
            "(expected an FSDD recordings folder or a Kaldi data dir)"
        )
    speakers = sorted(by_spk)
    # named test speakers only (no dev, no synth): a test set to eval on
    test_only = bool(test_speakers) and not dev_speakers and synth is None
    if not test_speakers:
        test_speakers = speakers[-1:]
    split_of = _split_speakers(speakers, test_speakers, dev_speakers, need_train=not test_only)
    synth_spk: dict[str, list[tuple[int, Path]]] = {}
    if synth is not None and synth_ratio > 0:
        synth_spk = _synth_speakers(Path(synth), speakers)
        n_real = sum(split_of[s] == "train" for s in speakers) * utterances
        per_synth = synth_counts(sorted(synth_spk), round(synth_ratio * n_real))
        synth_spk = {s: synth_spk[s] for s in sorted(synth_spk) if per_synth[s]}
        by_spk.update(synth_spk)
        split_of.update({s: "train" for s in synth_spk})
    for spk in speakers + sorted(synth_spk):
        n_utts = per_synth[spk] if spk in synth_spk else utterances
        recs, sr = _read_speaker(by_spk[spk], report)
        if not recs:
            continue
        split = split_of[spk]
        for i, (digits, samples) in enumerate(build_connected(recs, sr, n_utts, max_digits, rng)):
            utt = f"{spk}-{i:05d}"
            dst = out / split / "wav" / f"{utt}.wav"
            write_wav(dst, samples, sr)
            result[split].append(Utterance(utt, spk, [DIGIT_WORDS[d] for d in digits], str(dst.resolve())))
    return result


def prepare(
    data: str | Path,
    out: str | Path,
    test_speakers: list[str] | None = None,
    dev_speakers: list[str] | None = None,
    utterances: int = 200,
    max_digits: int = 7,
    seed: int = 0,
    synth: str | Path | None = None,
    synth_ratio: float = 1.0,
) -> PrepareReport:
    """Build ``out/{train,dev,test}`` Kaldi data dirs from an FSDD folder or a Kaldi data dir.

    Speakers in ``test_speakers`` go to test only (all of them: a test-only set), ``dev_speakers`` to dev
    only, the rest to train; without test speakers the last speaker (sorted) is held out for test.
    Unreadable recordings are skipped and counted. ``synth``: synthetic speakers added to the training split
    only, round(``synth_ratio`` x the real training utterances) shared as evenly as `synth_counts` can."""
    data, out = Path(data), Path(out)
    _check_prepare_args(data, out, utterances, max_digits, seed, synth_ratio)
    test_speakers, dev_speakers = list(test_speakers or []), list(dev_speakers or [])
    report = PrepareReport()
    rng = np.random.default_rng(seed)
    for split in SPLITS:  # a re-run replaces the old output rather than mixing with it
        if (out / split).exists():
            shutil.rmtree(out / split)
    if (data / "wav.scp").is_file():
        if synth is not None:
            raise MarianaError(
                "--synth mixes synthetic speakers into an FSDD folder's training set; "
                f"--data {data} is a Kaldi data dir"
            )
        result = _from_kaldi_dir(data, out, test_speakers, dev_speakers, report)
    else:
        result = _from_fsdd(
            data, out, test_speakers, dev_speakers, utterances, max_digits, rng, synth, synth_ratio, report
        )
    for split in SPLITS:
        write_kaldi_dir(out / split, result[split])
        report.counts[split] = len(result[split])
    return report


def synth_counts(voices: list[str], total: int) -> dict[str, int]:
    """Utterances per synthetic voice for ``total`` in all: ``total // len(voices)`` each, and one more
    for ``total % len(voices)`` voices spread evenly over the (sorted) list, so that a total below the
    number of voices takes voices from all of it rather than its first ones; a voice may get 0."""
    base, extra = divmod(total, len(voices))
    more = set(np.linspace(0, len(voices), extra, endpoint=False).astype(int).tolist()) if extra else set()
    return {v: base + (i in more) for i, v in enumerate(voices)}


def _synth_speakers(folder: Path, real: list[str]) -> dict[str, list[tuple[int, Path]]]:
    """The speakers of a ``--synth`` folder (FSDD names); a name also used by a real speaker is refused."""
    if not folder.is_dir():
        raise DataError(f"--synth {folder}: no such folder (expected the output of `mariana asr synth`)")
    found = scan_fsdd(folder)
    if not found:
        raise DataError(
            f"--synth {folder}: no '{{digit}}_{{speaker}}_{{take}}.wav' files (run `mariana asr synth`)"
        )
    clash = sorted(set(found) & set(real))
    if clash:
        raise MarianaError(
            f"--synth {folder}: speaker name(s) {', '.join(clash)} are also real speakers in --data"
        )
    return found


def parse_speakers(text: str | None) -> list[str]:
    return [s for s in (text or "").split(",") if s]
