"""A drifting click-log generator: days of Criteo-format logs whose ads, users and click rates change.

``mariana pctr drift-logs --out DIR --days 7 --rows-per-day 100000 --seed 0`` writes ``DIR/day-01.tsv``,
... (``label \t I1..I13 \t C1..C26``, as `data/encoding.py` reads with ``--format criteo``) and
``DIR/_generator.json`` (settings and per-day facts; the leading ``_`` keeps it out of folder readers).
Day files are written under a temporary name and renamed when complete, so a folder watcher never sees
half a day; the same settings give the same bytes. The world (ads born and retired, new users, click
logits drifting by a stationary AR(1) step) and the columns are described in apps/pctr/README.md,
Drifting click logs.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mariana.platform.core.atomic import atomic_write_path, atomic_write_text
from mariana.platform.core.errors import MarianaError
from mariana.platform.core.evaluator import roc_auc

if TYPE_CHECKING:
    import numpy as np

# Only the standard library at import time (`mariana --help` builds this command's flags from
# `DriftSettings`); numpy and pyarrow are imported where the data is made.

GENERATOR = "_generator.json"
# the files a run writes: day-NN.tsv and, while one is being written, .day-NN.tsv.XXXX.tmp (the same
# for _generator.json)
OWNED = re.compile(r"day-\d{2,}\.tsv|\.(day-\d{2,}\.tsv|_generator\.json)\..*\.tmp")

AD_COLUMNS = ("ad_id", "ad_cat", "ad_adv", "ad_pop", "ad_eff", "ad_born", "ad_size")  # per alive ad
NOISE_VOCAB = (10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000, 50, 500, 5000, 20, 200, 2000)


@dataclass
class DriftSettings:
    """Knobs of the generator (see the module docstring); `mariana pctr drift-logs --help` lists them."""

    days: int = 7
    rows_per_day: int = 100_000
    seed: int = 0
    ads: int = 20_000  # ads alive on any day
    new_ads: float = 0.25  # share of the alive ads replaced by newborn ads each new day
    new_users: float = 0.3  # share of a day's impressions from user ids never seen before
    users: int = 100_000  # users before day 1 (returning users on day 1)
    segments: int = 32
    categories: int = 24
    sites: int = 5_000
    drift: float = 0.5  # AR(1) innovation share of the affinities and ad effects per day (0 = frozen)
    affinity: float = 1.0  # std of the segment x category logits
    rank: int = 4  # latent taste dimensions behind the segment x category affinity
    ad_effect: float = 0.8  # std of an ad's own logit
    ctr: float = 0.12  # click rate of an average impression (sets the bias)

    def check(self) -> None:
        """MarianaError naming the knob when a value is out of range."""
        ints = dict(days=1, rows_per_day=1, ads=10, users=1, segments=1, categories=1, sites=1, rank=1)
        for name, lo in ints.items():
            if getattr(self, name) < lo:
                raise MarianaError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        for name in ("new_ads", "new_users", "drift"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise MarianaError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        for name in ("affinity", "ad_effect"):
            if not getattr(self, name) >= 0:
                raise MarianaError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.ctr < 1.0:
            raise MarianaError(f"--ctr must be in (0, 1), got {self.ctr}")


def hex8(x: np.ndarray, salt: int) -> np.ndarray:
    """Ids ``x`` int64 [n] -> 8-hex-digit strings (numpy ``S8`` [n]) of a bijective scramble of
    ``(x, salt)`` (so the same id reads differently in two fields, as in Criteo's hashed logs)."""
    import numpy as np

    hexd = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    z = (x.astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt * 40503 + 12345)) & np.uint64(
        0xFFFFFFFF
    )
    z ^= z >> np.uint64(15)
    z = (z * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    z ^= z >> np.uint64(12)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    digits = hexd[((z[:, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]
    return np.ascontiguousarray(digits).view("S8").reshape(-1)


def _zipf_index(rng: np.random.Generator, n: int, size: int, a: float = 1.1) -> np.ndarray:
    """``size`` draws from ``[0, n)`` with P(k) ~ 1 / (k + 1)^a (a power law; small k frequent)."""
    import numpy as np

    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    c = np.cumsum(w)
    return np.minimum(np.searchsorted(c, rng.random(size) * c[-1]), n - 1)


class DriftWorld:
    """The state that carries over from day to day (alive ads, users, affinities); `day()` draws a day."""

    def __init__(self, s: DriftSettings):
        import numpy as np

        s.check()
        self.s = s
        self.rng = rng = np.random.default_rng(s.seed)
        # latent tastes: segment and category factors [*, rank]; affinity = their dot product / sqrt(rank)
        self.seg_f = rng.normal(0.0, 1.0, (s.segments, s.rank))
        self.cat_f = rng.normal(0.0, 1.0, (s.categories, s.rank))
        self.site_eff = rng.normal(0.0, 0.4, s.sites)
        self.site_pop = rng.permutation(s.sites)  # popularity rank -> site id
        self.hour_eff = 0.3 * np.sin(np.arange(24) / 24 * 2 * np.pi)
        self.next_ad = 0
        for name in AD_COLUMNS:  # empty; `_birth` appends (the float columns promote on the first)
            setattr(self, name, np.zeros(0, np.int64))
        self._birth(s.ads, day=1)
        self.users = s.users  # user ids so far: [0, users)
        self.noise_perm = [rng.permutation(v) for v in NOISE_VOCAB]
        self.d = 0
        # the bias that puts an average impression near --ctr (logits are roughly centred)
        self.bias = float(np.log(s.ctr / (1 - s.ctr)))

    @property
    def affin(self) -> np.ndarray:
        """Segment x category affinity logits [segments, categories] (entries of std ``affinity``)."""
        return self.s.affinity * (self.seg_f @ self.cat_f.T) / self.s.rank**0.5

    def _birth(self, k: int, day: int) -> None:
        import numpy as np

        s, rng = self.s, self.rng
        self.ad_id = np.concatenate([self.ad_id, np.arange(self.next_ad, self.next_ad + k)])
        self.next_ad += k
        self.ad_cat = np.concatenate([self.ad_cat, rng.integers(0, s.categories, k)])
        self.ad_adv = np.concatenate([self.ad_adv, rng.integers(0, max(1, s.ads // 10), k)])
        self.ad_pop = np.concatenate([self.ad_pop, rng.lognormal(0.0, 1.0, k)])
        self.ad_eff = np.concatenate([self.ad_eff, rng.normal(0.0, s.ad_effect, k)])
        self.ad_born = np.concatenate([self.ad_born, np.full(k, day)])
        self.ad_size = np.concatenate([self.ad_size, rng.integers(0, 8, k)])

    def _advance(self, day: int) -> None:
        """From the previous day to ``day``: retire and give birth to ads, drift the logits."""
        import numpy as np

        s, rng = self.s, self.rng
        keep_w, new_w = np.sqrt(1.0 - s.drift**2), s.drift
        self.seg_f = keep_w * self.seg_f + new_w * rng.normal(0.0, 1.0, self.seg_f.shape)
        self.cat_f = keep_w * self.cat_f + new_w * rng.normal(0.0, 1.0, self.cat_f.shape)
        self.ad_eff = keep_w * self.ad_eff + new_w * rng.normal(0.0, s.ad_effect, len(self.ad_eff))
        k = int(round(s.new_ads * len(self.ad_id)))
        if k:
            alive = np.sort(rng.permutation(len(self.ad_id))[k:])
            for name in AD_COLUMNS:
                setattr(self, name, getattr(self, name)[alive])
            self._birth(k, day)

    def _int_columns(self, hour, age, uid, pos) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """I1..I13 of one day (int64 [n] each; inputs int64 [n]) and their missing masks (bool [n] or None):
        hour, ad age, a noisy activity count, position, then noise counts (draws in the generator's order)."""
        import numpy as np

        rng, n = self.rng, len(hour)
        ints = [
            hour,
            age,
            np.floor(rng.lognormal(1.0 + 0.2 * np.log1p(uid % 97), 1.0, n)).astype(np.int64),
            pos,
            np.floor(rng.pareto(1.2, n) * 10).astype(np.int64),
        ]
        for j in range(8):
            ints.append(rng.poisson(2 + 3 * j, n) if j % 2 else np.floor(rng.pareto(1.5, n) * (j + 1)))
        int_missing = [None] * 5 + [rng.random(n) < 0.1 for _ in range(8)]
        return [np.asarray(v, dtype=np.int64) for v in ints], int_missing

    def day(self) -> tuple[dict[str, np.ndarray], dict]:
        """Draw the next day: (columns by name -> arrays of ``rows_per_day``, facts about the day)."""
        import numpy as np

        s, rng = self.s, self.rng
        self.d += 1
        d = self.d
        if d > 1:
            self._advance(d)
        n = s.rows_per_day
        p = self.ad_pop / self.ad_pop.sum()
        a = np.searchsorted(np.cumsum(p), rng.random(n) * (1 - 1e-12))
        a = np.minimum(a, len(p) - 1)
        new = rng.random(n) < s.new_users
        k_new = int(new.sum())
        # returning users: recent users are the most active (power law over the ids, newest first)
        back = self.users - 1 - _zipf_index(rng, self.users, n - k_new, 0.9)
        uid = np.empty(n, np.int64)
        uid[~new] = back
        uid[new] = self.users + rng.integers(0, max(1, k_new // 2), k_new)  # a new user shows ~twice
        self.users += max(1, k_new // 2)
        seg = (uid * 2654435761 % 1_000_003) % s.segments
        user_eff = ((uid * 40503 % 1009) / 1009.0 - 0.5) * 0.6  # a fixed per-user taste, [-0.3, 0.3)
        site = self.site_pop[_zipf_index(rng, s.sites, n, 1.0)]
        hour = rng.integers(0, 24, n)
        pos = rng.integers(1, 6, n)
        cat = self.ad_cat[a]
        logit = (
            self.bias
            + self.affin[seg, cat]
            + self.ad_eff[a]
            + self.site_eff[site]
            + user_eff
            + self.hour_eff[hour]
            - 0.15 * (pos - 1)
        )
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        age = d - self.ad_born[a]
        int_cols, int_missing = self._int_columns(hour, age, uid, pos)
        age_bucket = np.minimum(age, 4) - (age >= 3)  # 0, 1, 2-3, 4+
        cats = [
            self.ad_id[a],
            cat,
            self.ad_adv[a],
            uid,
            seg,
            site,
            rng.integers(0, 4, n),
            hour,
            age_bucket,
            np.full(n, d % 7),
            self.ad_size[a],
        ]
        for j, v in enumerate(NOISE_VOCAB):
            cats.append(self.noise_perm[j][_zipf_index(rng, v, n, 1.05)])
        cat_missing = [None] * 25 + [rng.random(n) < 0.3]
        cols = {"label": label}
        for j, (v, m) in enumerate(zip(int_cols, int_missing)):
            cols[f"I{j + 1}"] = (v, m)
        for j, (v, m) in enumerate(zip(cats, cat_missing)):
            cols[f"C{j + 1}"] = (hex8(np.asarray(v, np.int64), j + 1), m)
        facts = {
            "day": d,
            "rows": n,
            "ctr": round(float(label.mean()), 4),
            "new_ad_traffic": round(float((self.ad_born[a] == d).mean()) if d > 1 else 1.0, 4),
            "new_user_traffic": round(float(new.mean()), 4),
            "distinct_ads": int(len(np.unique(self.ad_id[a]))),
            "distinct_users": int(len(np.unique(uid))),
            "ads_born_so_far": int(self.next_ad),
            # the AUC of the true click logits: the best any model can do on this day
            "oracle_auc": round(roc_auc(label, logit), 4),
        }
        return cols, facts


def write_tsv(path: Path, cols: dict) -> None:
    """Write one day's columns as Criteo TSV (``label \\t I1..I13 \\t C1..C26``, empty = missing),
    atomically (temporary name beside ``path``, renamed when complete)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    arrays, names = [pa.array(cols["label"])], ["label"]
    for name, (v, missing) in ((k, x) for k, x in cols.items() if k != "label"):
        arr = (
            pa.array(v, mask=missing) if v.dtype.kind != "S" else pa.array(v, mask=missing, type=pa.binary())
        )
        arrays.append(arr.cast(pa.string()) if v.dtype.kind == "S" else arr)
        names.append(name)
    table = pa.Table.from_arrays(arrays, names=names)
    opts = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")

    def write(tmp: str) -> None:
        pcsv.write_csv(table, tmp, opts)
        os.chmod(tmp, 0o644)  # the temporary file is private (0600); a day file is data like any other

    atomic_write_path(path, write)


def day_name(d: int) -> str:
    return f"day-{d:02d}.tsv"


def clear_owned(out: Path) -> list[str]:
    """Delete what an earlier drift-logs run left in ``out`` (``_generator.json``, ``day-NN.tsv`` and
    unfinished ``.day-NN.tsv.*.tmp``; nothing else), so that a re-run with ``--force`` leaves exactly the
    days it writes, described by its own ``_generator.json``. The description goes first: a run killed
    half-way never leaves a ``_generator.json`` naming days that are gone. Returns the names deleted."""
    gone = []
    for p in sorted(out.iterdir(), key=lambda p: p.name != GENERATOR):
        if p.is_file() and (p.name == GENERATOR or OWNED.fullmatch(p.name)):
            p.unlink()
            gone.append(p.name)
    return gone


def generate(out: str | Path, s: DriftSettings, progress=None) -> list[dict]:
    """Write ``s.days`` day files into ``out`` (created) and ``out/_generator.json``, after deleting the
    day files and description of an earlier run there (`clear_owned`; the CLI refuses an existing output
    without ``--force``); returns the per-day facts. ``progress``: a callable taking one line per day (default: print to stderr)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MarianaError(f"--out {out}: is an existing file, expected a folder")
    out.mkdir(parents=True, exist_ok=True)
    clear_owned(out)
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    world = DriftWorld(s)
    facts = []
    for d in range(1, s.days + 1):
        cols, f = world.day()
        write_tsv(out / day_name(d), cols)
        facts.append(f)
        say(
            f"day {d}/{s.days}: {f['rows']} rows, CTR {f['ctr']:.3f}, traffic on new ads "
            f"{f['new_ad_traffic']:.0%}, from new users {f['new_user_traffic']:.0%} -> {out / day_name(d)}"
        )
        atomic_write_text(out / GENERATOR, json.dumps({"settings": asdict(s), "days": facts}, indent=1))
    return facts
