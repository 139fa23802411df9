"""The word2vec demo: skip-gram with negative sampling and fastText subwords (private).

``python -m stpipe demo`` trains on :mod:`stpipe._corpus` text. Two tables:

* input table, ``vocab + buckets`` rows: a word's vector is the mean of its own row and its
  hashed character n-gram rows (fastText), so the table is large (2M buckets by default);
* output table, ``vocab`` rows: the context/negative vectors.

Each step takes ``batch`` centre words from the subsampled token stream, pairs each with
the words of a random window (1..``window``) around it in the same file, and draws
``negatives`` noise words per pair from the unigram distribution raised to 0.75. The loss
is the standard SGNS loss, ``-log σ(h·u_ctx) - Σ log σ(-h·u_neg)``, summed over pairs (the
progress bar shows its mean per pair).

Training engines:

* ``"stpipe"``: both tables (and the optimizer state) in :class:`stpipe.HostEmbedding`
  host tables, stepped by :class:`stpipe.Pipeline`;
* ``"torch"``: ``nn.Embedding(sparse=True)`` with a sparse optimizer on one device: the
  reference the tests compare against, and the fallback while the pipeline is absent.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from . import _corpus
from ._io import atomic_write
from ._corpus import Corpus, CorpusError, Vocab

__all__ = [
    "DemoConfig",
    "SkipGramData",
    "Batch",
    "TrainResult",
    "prepare",
    "train",
    "word_vectors",
    "neighbours",
    "save_vectors",
    "load_vectors",
    "pair_auc",
    "table_bytes",
    "PROBES",
]

#: Words whose neighbours the demo prints.
PROBES = ("append", "socket", "thread", "encode", "sort", "exception")

#: Optimizer state tensors per row (besides the row itself).
_STATE_PER_ROW = {"sgd": 0, "adagrad": 1, "adam": 2}
#: Default learning rates (loss summed over pairs).
DEFAULT_LR = {"sgd": 0.01, "adagrad": 0.2, "adam": 0.03}


@dataclass
class DemoConfig:
    """Everything a training run depends on."""

    dim: int = 64
    window: int = 5
    negatives: int = 5
    batch: int = 1024
    epochs: int = 1
    lr: Optional[float] = None
    optimizer: str = "adam"
    subsample: float = 1e-4
    min_count: int = 5
    buckets: int = 2_000_000
    minn: int = 3
    maxn: int = 6
    seed: int = 0
    device: str = "cpu"
    engine: str = "stpipe"

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def table_bytes(num_rows: int, dim: int, optimizer: str, itemsize: int = 4) -> int:
    """Host bytes of one table plus its per-row optimizer state."""
    return num_rows * dim * itemsize * (1 + _STATE_PER_ROW[optimizer])


@dataclass
class Batch:
    """One step's ids.

    Attributes:
        in_ids: ``(n,)`` int64 input-table rows of the centre words (own row + n-grams).
        in_seg: ``(n,)`` int64 centre number (0..B-1) of each ``in_ids`` entry.
        in_len: ``(B,)`` float32 rows per centre word (the mean's divisor).
        pair_center: ``(P,)`` int64 centre number of each (centre, context) pair.
        ctx: ``(P,)`` int64 output-table row of each pair's context word.
        neg: ``(P, K)`` int64 output-table rows of each pair's negatives.
        tokens: corpus tokens (before subsampling) this batch accounts for.
    """

    in_ids: np.ndarray
    in_seg: np.ndarray
    in_len: np.ndarray
    pair_center: np.ndarray
    ctx: np.ndarray
    neg: np.ndarray
    tokens: int

    @property
    def out_ids(self) -> np.ndarray:
        """``(P * (1 + K),)`` every output-table row the batch reads: contexts, then negatives."""
        return np.concatenate([self.ctx, self.neg.reshape(-1)])


class SkipGramData:
    """The encoded corpus, subwords and noise distribution of a run.

    Args:
        corpus: tokenised text.
        vocab: its vocabulary.
        cfg: the run's configuration (window, negatives, buckets, n-gram lengths,
            subsampling threshold, batch size).
    """

    def __init__(self, corpus: Corpus, vocab: Vocab, cfg: DemoConfig) -> None:
        self.vocab = vocab
        self.cfg = cfg
        self.ids, self.doc = vocab.encode(corpus)
        self.corpus_tokens = len(corpus)
        self.sub_ptr, self.sub_rows = _corpus.subword_table(
            vocab.words, cfg.buckets, len(vocab), cfg.minn, cfg.maxn)
        self.sub_len = np.diff(self.sub_ptr)
        freq = vocab.counts / vocab.counts.sum()
        t = cfg.subsample
        self.keep_prob = (np.minimum(1.0, np.sqrt(t / freq) + t / freq) if t > 0
                          else np.ones_like(freq))
        noise = vocab.counts.astype(np.float64) ** 0.75
        self.noise_cdf = np.cumsum(noise / noise.sum())
        self.noise_cdf[-1] = 1.0

    @property
    def in_rows(self) -> int:
        """Rows of the input table: vocabulary + n-gram buckets."""
        return len(self.vocab) + self.cfg.buckets

    @property
    def out_rows(self) -> int:
        """Rows of the output table: the vocabulary."""
        return len(self.vocab)

    def steps_per_epoch(self) -> int:
        """About how many batches an epoch gives (after expected subsampling)."""
        kept = float(self.keep_prob[self.ids].sum())
        return max(1, math.ceil(kept / self.cfg.batch))

    def batches(self, rng: np.random.Generator) -> Iterator[Batch]:
        """One epoch of batches (subsampling and windows drawn from ``rng``)."""
        cfg = self.cfg
        keep = rng.random(len(self.ids)) < self.keep_prob[self.ids]
        kpos = np.flatnonzero(keep)
        kids = self.ids[kpos].astype(np.int64)
        kdoc = self.doc[kpos]
        n = len(kids)
        W = cfg.window
        off = np.concatenate([np.arange(-W, 0), np.arange(1, W + 1)])
        total = len(self.ids)
        for bi, s in enumerate(range(0, n, cfg.batch)):
            p = np.arange(s, min(s + cfg.batch, n))
            B = len(p)
            b = rng.integers(1, W + 1, B)
            cp = p[:, None] + off[None, :]
            valid = (cp >= 0) & (cp < n) & (np.abs(off)[None, :] <= b[:, None])
            cpc = np.clip(cp, 0, n - 1)
            valid &= kdoc[cpc] == kdoc[p][:, None]
            pc, oc = np.nonzero(valid)
            ctx = kids[cpc[pc, oc]]
            neg = np.searchsorted(self.noise_cdf, rng.random((len(pc), cfg.negatives)))
            centres = kids[p]
            lens = self.sub_len[centres]
            starts = self.sub_ptr[centres]
            cum = np.cumsum(lens) - lens
            flat = np.repeat(starts - cum, lens) + np.arange(int(lens.sum()))
            in_ids = self.sub_rows[flat]
            in_seg = np.repeat(np.arange(B), lens)
            nxt = kpos[s + B] if s + B < n else total
            start_tok = kpos[s] if s else 0
            yield Batch(in_ids, in_seg, lens.astype(np.float32), pc.astype(np.int64),
                        ctx, neg.astype(np.int64), int(nxt - start_tok))


def sgns_loss(in_rows: torch.Tensor, in_seg: torch.Tensor, in_len: torch.Tensor,
              pair_center: torch.Tensor, ctx_rows: torch.Tensor,
              neg_rows: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The SGNS loss of one batch, summed over pairs.

    Args:
        in_rows: ``(n, dim)`` input rows (``in_seg`` says which centre each belongs to).
        in_seg: ``(n,)`` int64.
        in_len: ``(B,)`` rows per centre.
        pair_center: ``(P,)`` int64.
        ctx_rows: ``(P, dim)`` output rows of the contexts.
        neg_rows: ``(P, K, dim)`` output rows of the negatives.

    Returns:
        ``(loss, P)``.
    """
    B = in_len.shape[0]
    h = torch.zeros(B, in_rows.shape[1], dtype=in_rows.dtype, device=in_rows.device)
    h = h.index_add(0, in_seg, in_rows) / in_len[:, None]
    hp = h.index_select(0, pair_center)
    pos = (hp * ctx_rows).sum(-1)
    neg = (neg_rows * hp.unsqueeze(1)).sum(-1)
    loss = -(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum())
    return loss, int(pair_center.shape[0])


@dataclass
class TrainResult:
    """What a run produced."""

    in_table: torch.Tensor          # (vocab + buckets, dim) CPU view of the input table
    out_table: torch.Tensor         # (vocab, dim)
    data: SkipGramData
    seconds: float = 0.0
    tokens: int = 0                 # corpus tokens walked (before subsampling)
    centres: int = 0                # centre words trained (after subsampling)
    pairs: int = 0
    steps: int = 0
    losses: List[float] = field(default_factory=list)
    interrupted: bool = False
    modules: tuple = ()             # the HostEmbeddings (stpipe engine): keep tables alive

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def vectors(self) -> np.ndarray:
        """``(vocab, dim)`` float32 word vectors."""
        return word_vectors(self.in_table, self.data.sub_ptr, self.data.sub_rows)


def _init_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _init_in(num_rows: int, dim: int, seed: int) -> torch.Tensor:
    """fastText's initialisation of the input table: U(-1/dim, 1/dim)."""
    t = torch.empty(num_rows, dim)
    return t.uniform_(-1.0 / dim, 1.0 / dim, generator=_init_generator(seed))


def _train_torch(data: SkipGramData, cfg: DemoConfig, progress) -> TrainResult:
    """The reference engine: ``nn.Embedding(sparse=True)`` + a sparse optimizer."""
    device = torch.device(cfg.device)
    emb_in = torch.nn.Embedding(data.in_rows, cfg.dim, sparse=True)
    emb_out = torch.nn.Embedding(data.out_rows, cfg.dim, sparse=True)
    with torch.no_grad():
        emb_in.weight.copy_(_init_in(data.in_rows, cfg.dim, cfg.seed))
        emb_out.weight.zero_()
    emb_in.to(device)
    emb_out.to(device)
    params = list(emb_in.parameters()) + list(emb_out.parameters())
    lr = cfg.learning_rate
    if cfg.optimizer == "adam":
        opt = torch.optim.SparseAdam(params, lr=lr)
    elif cfg.optimizer == "adagrad":
        opt = torch.optim.Adagrad(params, lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr)
    res = TrainResult(emb_in.weight.data, emb_out.weight.data, data)
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    try:
        for _ in range(cfg.epochs):
            for b in data.batches(rng):
                P = len(b.pair_center)
                if P == 0:
                    res.tokens += b.tokens
                    continue
                tb = {k: torch.from_numpy(v).to(device) for k, v in
                      (("in_ids", b.in_ids), ("in_seg", b.in_seg), ("in_len", b.in_len),
                       ("pc", b.pair_center), ("ctx", b.ctx), ("neg", b.neg))}
                opt.zero_grad(set_to_none=True)
                loss, _ = sgns_loss(emb_in(tb["in_ids"]), tb["in_seg"], tb["in_len"], tb["pc"],
                                    emb_out(tb["ctx"]), emb_out(tb["neg"]))
                loss.backward()
                opt.step()
                res.steps += 1
                res.tokens += b.tokens
                res.centres += len(b.in_len)
                res.pairs += P
                res.losses.append(float(loss.detach()) / P)
                if progress is not None:
                    progress(res, b)
    except KeyboardInterrupt:
        res.interrupted = True
        raise
    finally:
        res.seconds = time.perf_counter() - t0
    res.in_table = emb_in.weight.data.cpu()
    res.out_table = emb_out.weight.data.cpu()
    return res


def train(data: SkipGramData, cfg: DemoConfig, progress=None) -> TrainResult:
    """Train the model; ``progress(result_so_far, batch)`` is called after every step."""
    if cfg.engine == "torch":
        return _train_torch(data, cfg, progress)
    if cfg.engine == "stpipe":
        return _train_stpipe(data, cfg, progress)
    raise ValueError(f"engine must be 'stpipe' or 'torch', got {cfg.engine!r}")


def stpipe_available() -> bool:
    """True when :class:`HostEmbedding` and :class:`Pipeline` can be imported."""
    try:
        _stpipe_classes()
    except ImportError:
        return False
    return True


def _stpipe_classes():
    from .embedding import HostEmbedding
    from .pipeline import Pipeline
    return HostEmbedding, Pipeline


def _make_optimizer(params, cfg: DemoConfig) -> torch.optim.Optimizer:
    """The dense optimizer the pipeline runs on each step's working rows."""
    lr = cfg.learning_rate
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer must be one of {tuple(_STATE_PER_ROW)}, got {cfg.optimizer!r}")


#: On CUDA, losses are read back (a host sync) once per this many steps, not every step.
_LOSS_SYNC_EVERY = 16


def _flush(pending: List[Tuple[torch.Tensor, int]], res: "TrainResult") -> None:
    """Move pending per-step losses (device tensors) into ``res.losses`` as floats."""
    if pending:
        values = torch.stack([l for l, _ in pending]).cpu().tolist()
        res.losses.extend(v / p for v, (_, p) in zip(values, pending))
        pending.clear()


def _train_stpipe(data: SkipGramData, cfg: DemoConfig, progress) -> TrainResult:
    """Both tables and their optimizer state in host tables, stepped by the pipeline.

    The batch generator runs in the pipeline's prefetch thread (it is the pipeline's
    iterable), so batch building, planning and gathering overlap the training step.
    """
    HostEmbedding, Pipeline = _stpipe_classes()
    device = torch.device(cfg.device)
    gen = _init_generator(cfg.seed)
    bound = 1.0 / cfg.dim

    def init_in(table):
        table.uniform_(-bound, bound, generator=gen)

    emb_in = HostEmbedding(data.in_rows, cfg.dim, device=device, init=init_in)
    emb_out = HostEmbedding(data.out_rows, cfg.dim, device=device, init="zeros")
    opt = _make_optimizer([emb_in.weight, emb_out.weight], cfg)
    res = TrainResult(emb_in.table.tensor(), emb_out.table.tensor(), data)
    rng = np.random.default_rng(cfg.seed)

    def batches():
        for _ in range(cfg.epochs):
            yield from data.batches(rng)

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.to(device, non_blocking=True) if device.type == "cuda" else t

    pending: List[Tuple[torch.Tensor, int]] = []
    t0 = time.perf_counter()
    try:
        with Pipeline({"in": emb_in, "out": emb_out}, optimizer=opt,
                      ids=lambda b: {"in": b.in_ids, "out": (b.ctx, b.neg)}) as pipe:
            for step in pipe.run(batches()):
                b = step.batch
                P = len(b.pair_center)
                if P == 0:  # nothing to learn; skipping the step writes nothing back
                    res.tokens += b.tokens
                    continue
                with step:
                    in_ids, (ctx, neg) = step.ids["in"], step.ids["out"]
                    loss, _ = sgns_loss(emb_in(in_ids), dev(b.in_seg), dev(b.in_len),
                                        dev(b.pair_center), emb_out(ctx),
                                        emb_out(neg))
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                res.steps += 1
                res.tokens += b.tokens
                res.centres += len(b.in_len)
                res.pairs += P
                pending.append((loss.detach(), P))
                if device.type != "cuda" or len(pending) >= _LOSS_SYNC_EVERY:
                    _flush(pending, res)
                if progress is not None:
                    progress(res, b)
    except KeyboardInterrupt:
        res.interrupted = True
        raise
    finally:
        res.seconds = time.perf_counter() - t0
    _flush(pending, res)
    emb_in.table.synchronize()
    emb_out.table.synchronize()
    res.in_table = emb_in.table.tensor()
    res.out_table = emb_out.table.tensor()
    res.modules = (emb_in, emb_out)
    return res


# --------------------------------------------------------------------------- evaluation

def word_vectors(in_table: torch.Tensor, ptr: np.ndarray, rows: np.ndarray,
                 chunk: int = 65536) -> np.ndarray:
    """Mean of each word's rows: ``(len(ptr) - 1, dim)`` float32."""
    table = in_table.detach().to("cpu", torch.float32)
    n = len(ptr) - 1
    out = np.empty((n, table.shape[1]), dtype=np.float32)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        r = torch.from_numpy(rows[ptr[s]:ptr[e]])
        offs = torch.from_numpy(ptr[s:e] - ptr[s])
        out[s:e] = F.embedding_bag(r, table, offs, mode="mean").numpy()
    return out


def _normalise(v: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return v / np.maximum(norm, 1e-12)


def neighbours(vectors: np.ndarray, words: Sequence[str], query: np.ndarray, k: int = 8,
               exclude: Sequence[int] = ()) -> List[Tuple[str, float]]:
    """The ``k`` words whose vectors have the highest cosine with ``query`` ``(dim,)``."""
    unit = _normalise(vectors)
    q = _normalise(query.astype(np.float32))
    sims = unit @ q
    for i in exclude:
        sims[i] = -np.inf
    k = min(k, len(words) - len(exclude))
    top = np.argpartition(-sims, k - 1)[:k] if k > 0 else np.zeros(0, dtype=np.int64)
    top = top[np.argsort(-sims[top], kind="stable")]
    return [(words[i], float(sims[i])) for i in top]


def pair_auc(vectors: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> float:
    """P(cosine of a positive pair > cosine of a negative pair), ties counted half.

    Args:
        vectors: ``(V, dim)``.
        pos, neg: ``(n, 2)`` int word-id pairs.
    """
    unit = _normalise(vectors)
    sp = np.einsum("ij,ij->i", unit[pos[:, 0]], unit[pos[:, 1]])
    sn = np.einsum("ij,ij->i", unit[neg[:, 0]], unit[neg[:, 1]])
    allv = np.concatenate([sp, sn])
    order = np.argsort(allv, kind="mergesort")
    ranks = np.empty(len(allv))
    # average ranks for ties
    sorted_v = allv[order]
    uniq, first, counts = np.unique(sorted_v, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    rp = ranks[: len(sp)].sum()
    return float((rp - len(sp) * (len(sp) + 1) / 2) / (len(sp) * len(sn)))


# --------------------------------------------------------------------------- files

def save_vectors(path: str, words: Sequence[str], vectors: np.ndarray, **meta) -> None:
    """Write ``words`` and ``vectors`` to ``path`` (``.npz``), atomically.

    The file is written to a temporary file in the same folder, flushed to disk and
    renamed into place, so an interruption leaves the old file (or none), never a
    partial one. ``meta`` values are stored as 0-d arrays (numbers or strings).
    """
    atomic_write(path, lambda fh: np.savez(
        fh, words=np.asarray(list(words), dtype=str),
        vectors=np.ascontiguousarray(vectors, dtype=np.float32),
        **{k: np.asarray(v) for k, v in meta.items()}))


def load_vectors(path: str) -> Tuple[List[str], np.ndarray, Dict[str, np.ndarray]]:
    """Read a file written by :func:`save_vectors` (no pickles).

    Returns:
        ``(words, vectors (V, dim) float32, meta)``.

    Raises:
        CorpusError: missing file, or not such a file.
    """
    if not os.path.isfile(path):
        raise CorpusError(f"vectors file {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = dict(z.items())
    except Exception as exc:
        raise CorpusError(f"{path!r} is not a vectors file written by --out: {exc}") from exc
    if "words" not in files or "vectors" not in files:
        raise CorpusError(f"{path!r} lacks 'words'/'vectors' arrays; was it written by --out?")
    words = [str(w) for w in files.pop("words")]
    vectors = files.pop("vectors")
    if vectors.ndim != 2 or vectors.shape[0] != len(words):
        raise CorpusError(f"{path!r}: vectors {vectors.shape} do not match {len(words)} words")
    return words, vectors.astype(np.float32, copy=False), files


def prepare(corpus_path: Optional[str], cfg: DemoConfig, max_tokens: Optional[int],
            files: Optional[Sequence[str]] = None) -> SkipGramData:
    """Read the corpus, build the vocabulary and subwords."""
    corpus = _corpus.read_corpus(corpus_path, max_tokens=max_tokens, seed=cfg.seed, files=files)
    vocab = _corpus.build_vocab(corpus, cfg.min_count)
    return SkipGramData(corpus, vocab, cfg)


def cooccurring_pairs(ids: np.ndarray, doc: np.ndarray, window: int, n: int,
                      rng: np.random.Generator) -> np.ndarray:
    """``(m <= n, 2)`` word-id pairs that occur within ``window`` of each other in one file.

    Pairs of a word with itself are left out.
    """
    if len(ids) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    i = rng.integers(0, len(ids), 2 * n)
    off = rng.integers(1, window + 1, 2 * n) * rng.choice([-1, 1], 2 * n)
    j = i + off
    ok = (j >= 0) & (j < len(ids))
    i, j = i[ok], j[ok]
    ok = (doc[i] == doc[j]) & (ids[i] != ids[j])
    pairs = np.stack([ids[i[ok]], ids[j[ok]]], axis=1).astype(np.int64)
    return pairs[:n]


def random_pairs(ids: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``(n, 2)`` pairs of tokens drawn independently from ``ids`` (frequency-matched chance)."""
    a = ids[rng.integers(0, len(ids), 2 * n)]
    b = ids[rng.integers(0, len(ids), 2 * n)]
    ok = a != b
    return np.stack([a[ok], b[ok]], axis=1).astype(np.int64)[:n]


def heldout_auc(vectors: np.ndarray, vocab: Vocab, heldout: Corpus, window: int = 2,
                n: int = 20000, seed: int = 1) -> float:
    """AUC of held-out co-occurring pairs against random pairs (0.5 = chance)."""
    ids, doc = vocab.encode(heldout)
    rng = np.random.default_rng(seed)
    return pair_auc(vectors, cooccurring_pairs(ids, doc, window, n, rng), random_pairs(ids, n, rng))
