"""Synthetic digit speakers from eSpeak NG (``mariana asr synth``): each speaker an accent x voice variant x
pitch and rate drawn from ``seed``, with per-take jitter. Output: ``OUT/{digit}_{speaker}_{take}.wav``
(FSDD layout, silence trimmed) plus ``OUT/synth.json`` (every speaker's settings). Readable files already
there are kept; missing or unreadable ones are (re)generated, words without audio skipped (both counted).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from mariana.platform.core.errors import MarianaError
from tqdm import tqdm

from .data import DIGIT_WORDS, check_out_dir, read_wav, write_wav

ACCENTS = ["en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd",
           "en-us-nyc"]  # fmt: skip
# Voice variants whose speech stays intelligible (the whisper/robot/novelty variants are left out).
VARIANTS = [
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5", "adam", "alex", "andy",
    "annie", "aunty", "belinda", "benjamin", "boris", "caleb", "david", "ed", "edward", "gene", "grandma",
    "grandpa", "gustave", "ian", "iven", "iven2", "iven3", "jacky", "john", "klatt", "klatt2", "klatt3",
    "klatt4", "lee", "linda", "marco", "max", "michael", "mike", "norbert", "paul", "quincy", "rob",
    "robert", "steph", "travis", "victor", "zac",
]  # fmt: skip
SYNTH_VERSION = 1  # bump when the generation changes, so caches are rebuilt


@dataclass
class SynthSpeaker:
    """One synthetic voice: eSpeak voice ``accent+variant``, words per minute, pitch and pitch range
    (eSpeak's 0-100 scales)."""

    name: str
    accent: str
    variant: str
    rate: int
    pitch: int
    range: int


@dataclass
class SynthReport:
    speakers: int
    files: int  # readable files in OUT after the run
    generated: int  # written this run (the rest came from the cache)
    regenerated: int  # cached files that were empty or unreadable and were written again
    skipped: list[tuple[str, str]]  # (file, reason): the engine gave no usable audio


class Espeak:
    """eSpeak NG through its C API (ctypes; synchronous mode, audio collected by a callback).

    The library keeps one global voice state, so calls are serialised by a lock."""

    _lock = threading.Lock()
    _instance: Espeak | None = None

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError:
            raise MarianaError(
                "mariana asr synth needs the eSpeak NG engine: pip install espeakng-loader "
                "(`make install` installs it)"
            ) from None
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self._chunks: list[np.ndarray] = []
        cb_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )

        def collect(wav, n, events):
            if n > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        self._cb = cb_type(collect)  # kept referenced: the library calls it for as long as it lives
        self.lib.espeak_Initialize.restype = ctypes.c_int
        data = espeakng_loader.get_data_path().encode()
        self.sample_rate = self.lib.espeak_Initialize(2, 0, data, 0)  # 2 = AUDIO_OUTPUT_SYNCHRONOUS
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed with data at {data.decode()}")
        self.lib.espeak_SetSynthCallback(self._cb)
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip

    @classmethod
    def get(cls) -> Espeak:
        with cls._lock:
            if cls._instance is None:
                cls._instance = Espeak()
            return cls._instance

    def speak(self, text: str, voice: str, rate: int, pitch: int, pitch_range: int) -> np.ndarray:
        """``text`` in ``voice`` (e.g. ``en-us+m3``) at ``rate`` words/minute -> int16 samples at
        ``self.sample_rate`` Hz (empty when the engine produced nothing)."""
        with self._lock:
            if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"eSpeak has no voice {voice!r}")
            for param, value in ((1, rate), (3, pitch), (4, pitch_range)):  # RATE, PITCH, RANGE
                self.lib.espeak_SetParameter(param, int(value), 0)
            self._chunks = []
            raw = text.encode()
            self.lib.espeak_Synth(raw, len(raw) + 1, 0, 1, 0, 1, None, None)  # POS_CHARACTER, CHARS_UTF8
            self.lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


def draw_speakers(n: int, seed: int) -> list[SynthSpeaker]:
    """``n`` distinct synthetic voices drawn from ``seed`` (accent x variant without repeats while they
    last; rate 120-220 words/minute, pitch 20-80, range 20-90)."""
    rng = np.random.default_rng(seed)
    combos = [(a, v) for a in ACCENTS for v in VARIANTS]
    order = rng.permutation(len(combos))
    out = []
    for i in range(n):
        accent, variant = combos[order[i % len(combos)]]
        out.append(
            SynthSpeaker(
                name=f"tts{seed}x{i:04d}",
                accent=accent,
                variant=variant,
                rate=int(rng.integers(120, 221)),
                pitch=int(rng.integers(20, 81)),
                range=int(rng.integers(20, 91)),
            )
        )
    return out


def trim_silence(x: np.ndarray, sr: int, floor_db: float = -40.0, keep_ms: float = 20.0) -> np.ndarray:
    """Cut leading/trailing samples whose 10 ms energy is ``floor_db`` under the loudest frame, keeping
    ``keep_ms`` of margin (FSDD recordings are trimmed to near-minimal silence)."""
    hop = max(1, sr // 100)
    frames = len(x) // hop
    if frames == 0:
        return x
    e = (x[: frames * hop].reshape(frames, hop) ** 2).mean(1) + 1e-12
    loud = np.nonzero(10 * np.log10(e / e.max()) > floor_db)[0]
    keep = int(sr * keep_ms / 1000)
    return x[max(0, loud[0] * hop - keep) : min(len(x), (loud[-1] + 1) * hop + keep)]


def _take(engine: Espeak, spk: SynthSpeaker, digit: int, take: int, seed: int, sr: int) -> np.ndarray:
    """One take: the speaker's rate and pitch jittered by this take's own generator, resampled to ``sr``
    (polyphase, scipy), trimmed, peak level drawn like a microphone's gain. Empty when the engine gave
    nothing usable."""
    from math import gcd

    from scipy.signal import resample_poly

    rng = np.random.default_rng([seed, int(spk.name.rsplit("x", 1)[1]), digit, take])
    rate = int(np.clip(spk.rate * rng.uniform(0.9, 1.1), 80, 450))
    pitch = int(np.clip(spk.pitch + rng.integers(-6, 7), 0, 100))
    raw = engine.speak(DIGIT_WORDS[digit], f"{spk.accent}+{spk.variant}", rate, pitch, spk.range)
    if raw.size == 0:
        return np.zeros(0, np.float32)
    x = raw.astype(np.float64) / 32768.0
    g = gcd(sr, engine.sample_rate)
    x = trim_silence(resample_poly(x, sr // g, engine.sample_rate // g), sr)
    peak = float(np.abs(x).max()) if x.size else 0.0
    if peak < 1e-4:
        return np.zeros(0, np.float32)
    return (x / peak * rng.uniform(0.3, 0.9)).astype(np.float32)


def speaker_files(out: Path, spk: SynthSpeaker, takes: int) -> list[tuple[int, int, Path]]:
    """(digit, take, path) of every file of ``spk``, in generation order."""
    return [(d, t, out / f"{d}_{spk.name}_{t}.wav") for d in range(10) for t in range(takes)]


def synth_speaker(out: Path, spk: SynthSpeaker, takes: int, seed: int, sr: int, write: set[str]):
    """Generate all of ``spk``'s takes in order from a freshly seeded engine and write the files named in
    ``write`` -> (files written, [(path, reason)] skipped). eSpeak NG keeps state between calls, so a
    speaker is reproducible only in order from a fresh engine (a new process per speaker)."""
    engine = Espeak.get()
    engine.lib.espeak_ng_SetRandSeed(ctypes.c_long(seed * 100_003 + int(spk.name.rsplit("x", 1)[1])))
    written, skipped = 0, []
    for digit, take, path in speaker_files(out, spk, takes):
        x = _take(engine, spk, digit, take, seed, sr)
        if path.name not in write:
            continue
        if x.size < sr // 40:  # under 25 ms: not a spoken digit
            skipped.append((str(path), f"the engine gave no audio for {DIGIT_WORDS[digit]!r}"))
            path.unlink(missing_ok=True)
            continue
        tmp = path.with_name(f".tmp-{path.name}")
        write_wav(tmp, x, sr)
        os.replace(tmp, path)  # a crash never leaves a half-written WAV under its final name
        written += 1
    return written, skipped


def _readable(path: Path) -> bool | None:
    """True: a readable WAV; False: present but empty/unreadable; None: missing."""
    if not path.is_file():
        return None
    try:
        read_wav(path)
        return True
    except MarianaError:
        return False


def synthesize(
    out: str | Path,
    speakers: int = 40,
    takes: int = 10,
    seed: int = 0,
    sample_rate: int = 8000,
    progress: bool = True,
    jobs: int = 2,
) -> SynthReport:
    """Write ``speakers`` x 10 digits x ``takes`` WAVs into ``out`` (FSDD names) and ``out/synth.json``;
    the same arguments give byte-identical files. ``jobs``: speakers generated in parallel processes."""

    if speakers < 1 or takes < 1:
        raise MarianaError(f"--speakers and --takes must be >= 1, got {speakers} and {takes}")
    if seed < 0:
        raise MarianaError(f"--seed must be >= 0, got {seed}")
    if sample_rate < 1000:
        raise MarianaError(f"--sample-rate must be at least 1000 Hz, got {sample_rate}")
    if jobs < 1:
        raise MarianaError(f"--jobs must be >= 1, got {jobs}")
    out = Path(out)
    check_out_dir(out)
    meta_path = out / "synth.json"
    settings = {"version": SYNTH_VERSION, "seed": seed, "sample_rate": sample_rate}
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in settings} != settings:
            # Files made with other settings would silently mix two recipes: start the folder afresh.
            for p in out.glob("*.wav"):
                p.unlink()
    voices = draw_speakers(speakers, seed)
    todo: dict[str, set[str]] = {}
    regenerated = 0
    for spk in voices:
        for _, _, path in speaker_files(out, spk, takes):
            ok = _readable(path)
            if ok is not True:
                todo.setdefault(spk.name, set()).add(path.name)
                regenerated += ok is False
    generated, skipped = 0, []
    if todo:
        import concurrent.futures as cf
        import multiprocessing as mp

        bar = tqdm(total=len(todo), desc="synth", unit="speaker", mininterval=2.0, disable=not progress)
        # A process per speaker (eSpeak's state never carries over), each forked from one server that imported
        # this module and the resampler once, not a new interpreter importing them again.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "scipy.signal"])
        with cf.ProcessPoolExecutor(jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
            futs = [
                pool.submit(synth_speaker, out, spk, takes, seed, sample_rate, todo[spk.name])
                for spk in voices
                if spk.name in todo
            ]
            for f in cf.as_completed(futs):
                n, sk = f.result()
                generated, skipped = generated + n, skipped + sk
                bar.update(1)
        bar.close()
    meta = dict(settings, takes=takes, speakers=[asdict(s) for s in voices])
    tmp = meta_path.with_name(".synth.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    files = sum(1 for s in voices for _, _, p in speaker_files(out, s, takes) if p.is_file())
    return SynthReport(len(voices), files, generated, regenerated, skipped)
