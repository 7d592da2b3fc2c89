"""``mariana asr train``: CTC training of the acoustic DNN or TDNN with synchronous data-parallel SGD.

Data: a prepared folder (``DATA/train`` and, optionally, ``DATA/dev`` Kaldi data dirs). Features come from
the sharded fp16 cache (built by rank 0 on first use, optionally with speed-perturbed copies); batches are
drawn length-bucketed so padding stays small; SpecAugment masks are applied on the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from mariana.platform.core import compilecache
from mariana.platform.core.errors import MarianaError
from mariana.platform.train.spec import TrainSpec, data_parallel, train_job

from .batches import bucket_frames, make_loader
from .configs import AsrAugment, AsrConfig, AsrDecode, AsrFeatures, AsrInput, AsrModel
from .decode import BigramLM, decode_set, error_rates
from .features import FeatureCache, UtteranceSet, cached_features, feature_settings, perturbations
from .model import build_model

BLANK = "<blank>"


class BucketBatchSampler:
    """Length-bucketed, deterministic, sharded batches (the `ShardedBatchSampler` contract).

    Each epoch: a seeded permutation is cut into pools of ``pool`` global batches; each pool is sorted by
    length and cut into global batches of ``batch_size x world_size`` similar-length utterances; the batch
    order is shuffled; rank r takes the r-th slice of each global batch."""

    def __init__(self, lengths, batch_size, rank=0, world_size=1, seed=0, pool=50):
        self.lengths, self.batch_size = torch.as_tensor(lengths), batch_size
        self.rank, self.world, self.seed, self.pool = rank, world_size, seed, pool
        self.batches_per_epoch = len(self.lengths) // (batch_size * world_size)
        if self.batches_per_epoch == 0:
            raise MarianaError(
                f"{len(self.lengths)} training utterances is less than one global batch "
                f"({batch_size} x {world_size} workers); prepare more --utterances or lower --batch-size"
            )

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=g)
        gb = self.batch_size * self.world
        perm = perm[: self.batches_per_epoch * gb]
        glob = []
        for p in range(0, len(perm), gb * self.pool):
            chunk = perm[p : p + gb * self.pool]
            chunk = chunk[torch.argsort(self.lengths[chunk], stable=True)]
            glob += [chunk[i : i + gb] for i in range(0, len(chunk), gb)]
        order = torch.randperm(len(glob), generator=g).tolist()
        lo = self.rank * self.batch_size
        for b in order[start:]:
            yield glob[b][lo : lo + self.batch_size].tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch


def spec_augment(feats: torch.Tensor, augment: AsrAugment) -> torch.Tensor:
    """Independent frequency and time masks per utterance (torchaudio), value 0 = the CMVN mean."""
    import torchaudio.transforms as T

    x = feats.transpose(1, 2).unsqueeze(1)  # [B, 1, F, T]
    for _ in range(augment.num_masks):
        x = T.FrequencyMasking(augment.freq_mask, iid_masks=True)(x)
        x = T.TimeMasking(augment.time_mask, iid_masks=True)(x)
    return x.squeeze(1).transpose(1, 2)


def stretch_plan(
    lengths: torch.Tensor, t: int, lo: float, hi: float, segment: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The random tempo change of a batch, on the host: lengths [B] valid frames of a batch padded to ``t``
    -> (rate [B, t] output frames per input frame, 0 past each utterance's end; new lengths [B] (host, what
    CTC needs); padded output frames, a bucket length >= every new length). Every run of ``segment`` input
    frames (the whole utterance when 0) gets its own factor drawn log-uniformly from [lo, hi] (> 1 =
    slower, more frames) from the CPU generator, so every device draws the same factors."""
    b = len(lengths)
    seg = segment if segment > 0 else t
    nseg = -(-t // seg)
    u = torch.rand(b, nseg)
    rate = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    rate = rate.repeat_interleave(seg, dim=1)[:, :t] * (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1))
    last = (lengths - 1).clamp_min(0)
    new_len = rate.cumsum(1).gather(1, last.unsqueeze(1)).squeeze(1).floor().long().clamp_min(1)
    return rate, new_len, bucket_frames(int(math.floor(t * hi)) + 1)


def time_stretch(
    feats: torch.Tensor, lengths: torch.Tensor, lo: float, hi: float, segment: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tempo change on the frame axis (linear interpolation between frames), on the device with no
    read-back: feats [B, T, F] padded, lengths [B] on the host -> (feats [B, T', F], T' a bucket length
    (`stretch_plan`); new lengths [B] on the host)."""
    b, t, f = feats.shape
    dev = feats.device
    rate_h, new_len_h, t_out = stretch_plan(lengths, t, lo, hi, segment)
    rate = rate_h.to(dev, non_blocking=True)
    new_len = new_len_h.to(dev, non_blocking=True)
    last = (lengths - 1).clamp_min(0).to(dev, non_blocking=True)
    end = torch.cumsum(rate, 1)  # output time at which each input frame ends
    start = end - rate  # ... and begins (non-decreasing, as searchsorted needs)
    out_t = torch.arange(t_out, device=dev, dtype=start.dtype).unsqueeze(0).expand(b, -1)
    k = (torch.searchsorted(start.contiguous(), out_t.contiguous(), right=True) - 1).clamp(0, t - 1)
    pos = k + ((out_t - start.gather(1, k)) / rate.gather(1, k).clamp_min(1e-6)).clamp(0, 1)
    pos = torch.minimum(pos, last.unsqueeze(1).to(pos.dtype))
    i0 = pos.floor().long()
    i1 = torch.minimum(i0 + 1, last.unsqueeze(1))
    w = (pos - i0).unsqueeze(-1).to(feats.dtype)
    g0 = feats.gather(1, i0.unsqueeze(-1).expand(-1, -1, f))
    g1 = feats.gather(1, i1.unsqueeze(-1).expand(-1, -1, f))
    out = g0 + w * (g1 - g0)
    mask = torch.arange(t_out, device=dev).unsqueeze(0) < new_len.unsqueeze(1)
    return out * mask.unsqueeze(-1), new_len_h


def make_step_fn(augment: AsrAugment):
    """One micro-batch's CTC loss -> (loss, utterances). The lengths CTC takes come from the batch's host
    ``sizes`` (`HostSizes`; the model gets the device copy), so the step reads nothing back."""

    def step_fn(model, batch):
        feats = batch["feats"]
        sizes = batch.get("sizes")
        lengths = sizes.lengths if sizes is not None else batch["lengths"].cpu()
        target_lengths = sizes.target_lengths if sizes is not None else batch["target_lengths"].cpu()
        dev_lengths = batch["lengths"]
        if augment.time_stretch != [1.0, 1.0]:
            feats, lengths = time_stretch(feats, lengths, *augment.time_stretch, augment.stretch_segment)
            dev_lengths = lengths.to(feats.device, non_blocking=True)
        if augment.spec_augment:
            feats = spec_augment(feats, augment)
        logp = model(feats, dev_lengths)
        loss = F.ctc_loss(
            logp.transpose(0, 1),
            batch["targets"],
            lengths,
            target_lengths,
            blank=0,
            reduction="mean",
            zero_infinity=True,
        )
        return loss, feats.shape[0]

    return step_fn


def compiles(acoustic: AsrModel, device: torch.device | str) -> bool:
    """Whether training compiles the model on ``device``: ``--compile`` / ``--no-compile`` when given, else
    on a GPU only (there the eager step is launch-bound, `bench/asr_throughput.py`; on the CPU compute-bound)."""
    return acoustic.compile if acoustic.compile is not None else torch.device(device).type == "cuda"


def compile_model(model: torch.nn.Module, acoustic: AsrModel) -> torch.nn.Module:
    """The model torch.compiled with ``--compile-backend`` where `compiles` says so, else itself (frames come
    in bucket lengths: no new shape after the first epoch)."""
    if not compiles(acoustic, next(model.parameters()).device):
        return model
    return torch.compile(model, backend=acoustic.compile_backend)


def compile_cache_file(acoustic: AsrModel, config: dict, n_units: int, device: torch.device) -> Path | None:
    """Where the model's compiled artifacts are kept between runs (`compilecache`; keyed by the run's
    values ``config``); None if it is not compiled."""
    if not compiles(acoustic, device):
        return None
    fields = ("arch", "features", "num_mel_bins", "num_ceps", "context", "hidden", "layers", "output_units")
    fields += ("activation", "dropout", "norm", "batch_size", "amp", "compile_backend", "workers")
    key = json.dumps({f: config[f] for f in fields} | {"units": n_units}, sort_keys=True)
    return compilecache.cache_path(key, torch.device(device))


def flush_denormals_on_cpu(device) -> None:
    """Treat denormal floats as zero on the CPU. The CTC gradient of a wide output layer (12000 units of
    which 11 are ever targets) is mostly softmax probabilities of ~1e-40, and x86 matmuls on denormals
    run far slower (`bench/asr_throughput.py` measures it); flushing changes no value above 1.2e-38."""
    if torch.device(device).type == "cpu":
        torch.set_flush_denormal(True)


class AsrData(NamedTuple):
    """`load_sets`' result: the vocabulary is [BLANK] + sorted words, ``lm`` the transcripts' bigram."""

    cache: FeatureCache
    train: UtteranceSet
    dev: UtteranceSet | None
    vocab: list[str]
    lm: BigramLM


def load_sets(input: AsrInput, feats: AsrFeatures, augment: AsrAugment, ctx, log) -> AsrData:
    """Build (rank 0) or read (the other ranks) the feature caches of DATA/train and DATA/dev (the output
    of ``mariana asr prepare``), denormals flushed on the CPU first (`flush_denormals_on_cpu`)."""
    flush_denormals_on_cpu(ctx.device)
    data, jobs, a = Path(input.data), input.feature_jobs, augment
    if not (data / "train" / "wav.scp").is_file():
        raise MarianaError(
            f"--data {data}: no train/wav.scp; expected the output of `mariana asr prepare` (e.g. "
            f"`mariana asr prepare --data {data} --out {data.name}-prepared`, then --data {data.name}-prepared)"
        )
    train_dir, dev_dir = data / "train", data / "dev"
    if not (train_dir / "wav.scp").read_text().strip():  # what `asr prepare --test-speakers` leaves
        raise MarianaError(
            f"--data {data}: train/wav.scp lists no utterances (a test-only set: evaluate on it with "
            f"`mariana asr eval --model RUN --data {data}/test`, or train on a prepared set with train data)"
        )
    s = feature_settings(feats)
    copies = perturbations(tuple(a.speed_perturb), tuple(a.vtln_perturb), tuple(a.pitch_perturb))
    has_dev = (dev_dir / "wav.scp").is_file() and (dev_dir / "wav.scp").stat().st_size > 0
    root = (lambda split: Path(input.cache) / split) if input.cache else (lambda split: None)
    if ctx.is_main:  # one process computes the caches; the others wait and read them
        cache = cached_features(train_dir, s, jobs, copies, root("train"))
        if has_dev:
            cached_features(dev_dir, s, jobs, cache_root=root("dev"), prior=cache.prior(s.cmvn))
    ctx.barrier()
    cache = cached_features(train_dir, s, 1, copies, root("train"))
    if cache.skipped and ctx.is_main:
        log.warning(
            "skipped %d unreadable recording(s): %s",
            len(cache.skipped),
            "; ".join(f"{x['path']} ({x['reason']})" for x in cache.skipped[:5]),
        )
    vocab = [BLANK] + sorted({w for u in cache.utts for w in u["words"]})
    # The digit-loop grammar: a word bigram of the training transcripts, stored in the export.
    lm = BigramLM.from_text(train_dir / "text", vocab)
    train_set = UtteranceSet(cache, vocab)
    dev_set = (
        UtteranceSet(cached_features(dev_dir, s, 1, cache_root=root("dev"), prior=cache.prior(s.cmvn)), vocab)
        if has_dev
        else None
    )
    log.info(
        "%d training utterances (%d frames), %d dev, vocabulary %d + blank, %d worker(s)",
        len(train_set),
        sum(cache.lengths),
        len(dev_set) if dev_set else 0,
        len(vocab) - 1,
        ctx.world_size,
    )
    return AsrData(cache, train_set, dev_set, vocab, lm)


def acoustic_model(data: AsrData, feats: AsrFeatures, acoustic: AsrModel, log) -> torch.nn.Module:
    """The acoustic model of ``data``'s vocabulary (`build_model` reads the config's dict)."""
    model = build_model(dataclasses.asdict(feats) | dataclasses.asdict(acoustic), len(data.vocab))
    log.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def compiled(module, data: AsrData, config: dict, run, dp, acoustic: AsrModel, ctx, app, log):
    """`data_parallel`'s model compiled, with an earlier run's compiled artifacts loaded (`compilecache`)."""
    model = compile_model(data_parallel(module, run, dp, ctx, app), acoustic)
    cached = compile_cache_file(acoustic, config, len(data.vocab), ctx.device)
    if cached is not None and compilecache.load(cached):
        log.info("compiled artifacts loaded from %s", cached)
    return model


def batches(data: AsrData, cfg: AsrConfig, optim, run, ctx, log):
    """Length-bucketed batches from the cache tier ``--cache-gb`` picks (`make_loader`)."""
    sampler = BucketBatchSampler(data.train.lengths, optim.batch_size, ctx.rank, ctx.world_size, run.seed)
    loader, tier = make_loader(cfg, data.train, sampler, ctx.device)
    log.info("feature cache tier: %s (--cache-gb %g)", tier, cfg.cache_gb)
    return loader


def dev_decoder(data: AsrData, decode: AsrDecode):
    """-> the dev set's WER/SER as a function of the model, or None without DATA/dev."""
    if data.dev is None:
        return None
    d = decode

    def eval_fn(m):
        r = error_rates(
            *decode_set(m, data.dev, data.vocab, d.beam, None, data.lm, d.lm_weight, d.word_bonus)
        )
        return {"wer": r["wer"], "ser": r["ser"]}

    return eval_fn


def export_keys(data: AsrData, acoustic: AsrModel) -> dict:
    """The export's arch and extra keys: vocab, the bigram, the training frames and the CMVN prior single
    files are normalised with (`transcribe`, serving)."""
    meta = {"vocab": data.vocab, "train_frames": sum(data.cache.lengths), "lm": data.lm.to_dict()}
    if data.cache.speaker_stats:
        meta["cmvn_prior"] = data.cache.prior("file").to_dict()
    return {"arch": f"{acoustic.arch}-ctc", "extra": meta}


def save_compiled(acoustic: AsrModel, config: dict, data: AsrData, ctx, log) -> None:
    """After training: rank 0 keeps the compiled artifacts for the next run of this model."""
    cached = compile_cache_file(acoustic, config, len(data.vocab), ctx.device)
    if cached is not None and ctx.is_main and compilecache.save(cached):
        log.info("compiled artifacts saved to %s (the next run of this model starts faster)", cached)


SPEC = TrainSpec(
    "asr",
    "wer",
    data=load_sets,
    module=acoustic_model,
    model=compiled,
    loader=batches,
    loss_fn=make_step_fn,
    evaluate=dev_decoder,
    export=export_keys,
    finish=save_compiled,
)


def train(cfg: AsrConfig) -> dict:
    """Train on cfg.data (a prepared folder) -> the Trainer's final metrics (dev WER/SER when DATA/dev exists)."""
    return train_job(SPEC, cfg)
