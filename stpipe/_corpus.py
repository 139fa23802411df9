"""The demo's corpus: finding text, tokenising it, vocabulary and character n-grams (private).

The default corpus is the source of the Python standard library installed on this machine
(found through :mod:`sysconfig`): real text, present wherever Python is, written by no one
here. Identifiers are split into words (``getaddrinfo`` stays whole, ``socket_timeout`` and
``SocketTimeout`` give ``socket`` and ``timeout``), lowercased, and kept whole as well when
they had several parts; words in comments and docstrings come out the same way.

Words get fastText-style subwords: the character n-grams (n = 3..6) of ``<word>``, each
hashed with 32-bit FNV-1a (over its UTF-8 bytes) into one of ``buckets`` rows placed after
the vocabulary rows. A word's vector is the mean of its own row and its n-gram rows.
"""
from __future__ import annotations

import os
import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "CorpusError",
    "Corpus",
    "Vocab",
    "default_corpus_root",
    "corpus_files",
    "tokenize",
    "read_corpus",
    "build_vocab",
    "fnv1a_32",
    "char_ngrams",
    "subword_table",
]

#: Folders never read from the standard library (third-party code and caches).
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn",
              "node_modules", ".tox", ".venv", "venv"}
#: Bytes read to decide whether a file is text.
_SNIFF = 4096
#: Longest token kept (long identifiers are mostly noise).
MAX_TOKEN_LEN = 40

_IDENT = re.compile(r"[^\W\d]\w*")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+")


class CorpusError(ValueError):
    """The corpus cannot be used: missing path, no readable text, no words."""


def default_corpus_root() -> str:
    """The installed standard library's source folder (``sysconfig`` ``stdlib`` path)."""
    return sysconfig.get_paths()["stdlib"]


def _is_text(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF)
    except OSError:
        return False
    return b"\0" not in head


def corpus_files(path: Optional[str] = None) -> List[str]:
    """Text files of a corpus, in sorted order.

    Args:
        path: a text file or a folder (searched recursively; binary files, hidden folders
            and ``site-packages``/``__pycache__`` are skipped). None means the standard
            library, whose ``*.py`` files are taken.

    Returns:
        The file paths, sorted.

    Raises:
        CorpusError: the path does not exist, or holds no text file.
    """
    default = path is None
    root = default_corpus_root() if default else os.path.expanduser(path)
    if not os.path.exists(root):
        what = "the standard library folder" if default else "corpus path"
        raise CorpusError(f"{what} {root!r} does not exist; pass --corpus FILE_OR_FOLDER")
    if os.path.isfile(root):
        if not _is_text(root):
            raise CorpusError(f"corpus file {root!r} is not a readable text file")
        return [root]
    files: List[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            full = os.path.join(d, name)
            if default:
                if name.endswith(".py"):
                    files.append(full)
            elif os.path.isfile(full) and _is_text(full):
                files.append(full)
    if not files:
        kind = "Python source" if default else "text"
        raise CorpusError(f"no {kind} files under {root!r}; pass --corpus FILE_OR_FOLDER")
    return files


_split_cache: Dict[str, Tuple[str, ...]] = {}


def _split_identifier(ident: str, keep_whole: bool) -> Tuple[str, ...]:
    parts: List[str] = []
    for piece in ident.split("_"):
        if not piece:
            continue
        if piece.isascii():
            parts.extend(w.lower() for w in _CAMEL.findall(piece))
        else:
            parts.append(piece.lower())
    parts = [p for p in parts if 2 <= len(p) <= MAX_TOKEN_LEN]
    if keep_whole and len(parts) > 1:
        whole = ident.lower().strip("_")
        if len(whole) <= MAX_TOKEN_LEN:
            parts.insert(0, whole)
    return tuple(parts)


def tokenize(text: str, keep_identifiers: bool = True) -> List[str]:
    """Split text into lowercase words.

    Args:
        text: any text (source code, prose).
        keep_identifiers: also keep a compound identifier whole (``socket_timeout``) just
            before its parts.

    Returns:
        The words, in order. Numbers and one-letter words are dropped.

    Example::

        >>> tokenize("self.sock = socket.create_connection(addr)  # HTTPServer")
        ['self', 'sock', 'socket', 'create_connection', 'create', 'connection', 'addr', 'httpserver', 'http', 'server']
    """
    out: List[str] = []
    cache = _split_cache
    for ident in _IDENT.findall(text):
        key = ident if keep_identifiers else "\0" + ident
        got = cache.get(key)
        if got is None:
            got = _split_identifier(ident, keep_identifiers)
            if len(cache) < 2_000_000:
                cache[key] = got
        out.extend(got)
    return out


@dataclass
class Corpus:
    """Tokenised text.

    Attributes:
        tokens: the words of every file, concatenated.
        doc_starts: ``(num_docs,)`` int64, where each file's words start in ``tokens``
            (contexts never cross a file boundary).
        files: the files read.
        files_total: the files the corpus holds (more than ``files`` when capped).
    """

    tokens: List[str]
    doc_starts: np.ndarray
    files: List[str]
    files_total: int

    def __len__(self) -> int:
        return len(self.tokens)


def read_corpus(path: Optional[str] = None, max_tokens: Optional[int] = None, seed: int = 0,
                keep_identifiers: bool = True, files: Optional[Sequence[str]] = None) -> Corpus:
    """Read and tokenise a corpus, stopping after about ``max_tokens`` words.

    Files are read in a seeded random order, so a capped run samples the whole corpus
    rather than its alphabetically first modules.

    Args:
        path: file or folder; None for the standard library (see :func:`corpus_files`).
        max_tokens: stop once this many words are read (the last file is cut); None or
            0 reads everything.
        seed: the file order's seed.
        keep_identifiers: see :func:`tokenize`.
        files: read these files instead of listing ``path``.

    Raises:
        CorpusError: missing path, no text files, or no words at all.
    """
    all_files = list(files) if files is not None else corpus_files(path)
    order = list(all_files)
    random.Random(seed).shuffle(order)
    tokens: List[str] = []
    starts: List[int] = []
    used: List[str] = []
    for name in order:
        if max_tokens and len(tokens) >= max_tokens:
            break
        try:
            with open(name, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        words = tokenize(text, keep_identifiers)
        if not words:
            continue
        if max_tokens:
            words = words[: max_tokens - len(tokens)]
        starts.append(len(tokens))
        tokens.extend(words)
        used.append(name)
    if not tokens:
        where = path or default_corpus_root()
        raise CorpusError(f"the corpus at {where!r} holds no words (empty or not text)")
    return Corpus(tokens, np.asarray(starts, dtype=np.int64), used, len(all_files))


@dataclass
class Vocab:
    """Words kept for training, most frequent first.

    Attributes:
        words: the words; ``words[i]`` has row ``i``.
        counts: ``(V,)`` int64 occurrences in the corpus.
        index: word -> row.
    """

    words: List[str]
    counts: np.ndarray
    index: Dict[str, int]

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, corpus: Corpus) -> Tuple[np.ndarray, np.ndarray]:
        """The corpus as word ids, out-of-vocabulary words dropped.

        Returns:
            ``(ids, doc)``: ``(n,)`` int32 word ids and ``(n,)`` int32 file number of each.
        """
        get = self.index.get
        raw = np.fromiter((get(t, -1) for t in corpus.tokens), dtype=np.int32,
                          count=len(corpus.tokens))
        doc = np.zeros(len(raw), dtype=np.int32)
        if len(corpus.doc_starts) > 1:
            doc[corpus.doc_starts[1:]] = 1
            doc = np.cumsum(doc, dtype=np.int32)
        keep = raw >= 0
        return raw[keep], doc[keep]


def build_vocab(corpus: Corpus, min_count: int = 5, max_size: Optional[int] = None) -> Vocab:
    """Words occurring at least ``min_count`` times, most frequent first (ties by word).

    Raises:
        CorpusError: no word occurs ``min_count`` times.
    """
    counts = Counter(corpus.tokens)
    items = sorted(((w, c) for w, c in counts.items() if c >= min_count),
                   key=lambda wc: (-wc[1], wc[0]))
    if max_size:
        items = items[:max_size]
    if not items:
        raise CorpusError(
            f"no word occurs at least {min_count} times in the corpus "
            f"({len(corpus)} words, {len(counts)} distinct); use a larger corpus or lower --min-count"
        )
    words = [w for w, _ in items]
    return Vocab(words, np.asarray([c for _, c in items], dtype=np.int64),
                 {w: i for i, w in enumerate(words)})


_FNV_OFFSET = 2166136261
_FNV_PRIME = 16777619


def fnv1a_32(data: bytes) -> int:
    """32-bit FNV-1a hash of ``data``."""
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def char_ngrams(word: str, minn: int = 3, maxn: int = 6) -> List[str]:
    """Character n-grams of ``<word>`` (fastText), shortest first per start position."""
    w = f"<{word}>"
    return [w[i:i + n] for i in range(len(w)) for n in range(minn, maxn + 1) if i + n <= len(w)]


def _ngram_hashes(word: str, minn: int, maxn: int) -> List[int]:
    """FNV-1a of each n-gram of ``<word>``, computed incrementally per start position."""
    chars = [c.encode("utf-8") for c in f"<{word}>"]
    out: List[int] = []
    n_chars = len(chars)
    for i in range(n_chars):
        h = _FNV_OFFSET
        for j in range(i, min(i + maxn, n_chars)):
            for b in chars[j]:
                h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFF
            if j - i + 1 >= minn:
                out.append(h)
    return out


def subword_table(words: Sequence[str], buckets: int, offset: int, minn: int = 3,
                  maxn: int = 6) -> Tuple[np.ndarray, np.ndarray]:
    """Rows of each word: itself (when in the vocabulary) then its hashed n-grams.

    Args:
        words: the words; ``words[i]`` is given row ``i`` when ``offset`` is not None
            ... see ``offset``.
        buckets: n-gram bucket count (0 disables n-grams).
        offset: first bucket row (the vocabulary size); word ``i`` gets its own row ``i``
            first. Pass ``offset=-1``... (not used): out-of-vocabulary words are looked up
            with :func:`oov_rows`.
        minn, maxn: n-gram lengths.

    Returns:
        ``(ptr, rows)``: CSR form; word ``i``'s rows are ``rows[ptr[i]:ptr[i + 1]]``
        (``ptr`` ``(V + 1,)`` int64, ``rows`` int64).
    """
    ptr = np.zeros(len(words) + 1, dtype=np.int64)
    rows: List[int] = []
    for i, w in enumerate(words):
        rows.append(i)
        if buckets > 0:
            rows.extend(offset + h % buckets for h in _ngram_hashes(w, minn, maxn))
        ptr[i + 1] = len(rows)
    return ptr, np.asarray(rows, dtype=np.int64)


def oov_rows(word: str, buckets: int, offset: int, minn: int = 3, maxn: int = 6) -> np.ndarray:
    """N-gram rows of a word outside the vocabulary (empty when ``buckets`` is 0)."""
    if buckets <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray([offset + h % buckets for h in _ngram_hashes(word, minn, maxn)],
                      dtype=np.int64)
