# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True, embedsignature=True
"""Compiled core of the index planner (the Python face is :mod:`stpipe.planner`).

Every ``def`` here takes 1-d C-contiguous int32 or int64 arrays that
:mod:`stpipe.planner` has already validated (type, range); the work runs in
``cdef ... noexcept nogil`` helpers with the GIL released, so a prefetch thread can
plan batch N+1 while the training thread runs Python.

Algorithm of :func:`plan_unchecked` for ``n`` ids over ``num_rows`` rows:

* ids below a counting window (the whole table when ``num_rows <= max(4 n, 2**13)``,
  else the first 2**13 rows) are counted in a dense, cache-resident array; their
  unique ids come out sorted by construction. Skewed batches (Zipf ranks,
  frequency-sorted vocabularies) put most of their ids there;
* the other ids, packed as ``id << bits(n) | position`` (when that fits in 64 bits), are
  LSD radix sorted on the id bits only (one read fills every histogram; passes whose
  digit is constant are skipped), then one scan emits unique ids, counts and inverse;
* otherwise (ids and batch too wide to pack): open-addressing hash table (power-of-two capacity >= 2 n, multiplicative
  hash) that numbers the distinct ids in order of first appearance, then an LSD radix
  sort (11-bit digits, only as many passes as ``num_rows`` has bits) of the ``k``
  distinct ids alone, so skewed (Zipf) batches sort only their few distinct ids.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcmp, memcpy, memset

import numpy as np

cimport numpy as cnp

cnp.import_array()

ctypedef fused index_t:
    int32_t
    int64_t

cdef enum:
    _RADIX_BITS = 11
    _RADIX = 2048


cdef inline Py_ssize_t _first_out_of_range(const index_t[::1] ids, int64_t num_rows) noexcept nogil:
    """Position of the first id outside ``[0, num_rows)``, or -1 when all are valid."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef int64_t lo = 0, hi = 0, v
    if n == 0:
        return -1
    lo = ids[0]
    hi = ids[0]
    # min/max first: a branch-free loop the compiler vectorises; only a bad batch scans again
    for i in range(n):
        v = ids[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    if lo >= 0 and hi < num_rows:
        return -1
    for i in range(n):
        v = ids[i]
        if v < 0 or v >= num_rows:
            return i
    return -1


def first_out_of_range(const index_t[::1] ids not None, int64_t num_rows):
    """Return the position of the first id outside ``[0, num_rows)``, or -1.

    Args:
        ids: ``(n,)`` int32 or int64, C-contiguous.
        num_rows: the table's row count.
    """
    cdef Py_ssize_t pos
    with nogil:
        pos = _first_out_of_range(ids, num_rows)
    return pos


cdef inline Py_ssize_t _scan_ids(const index_t[::1] ids, int64_t num_rows, int* order) noexcept nogil:
    """:func:`_first_out_of_range` and the ids' order: ``order`` is set to 2 (strictly
    increasing), 1 (non-decreasing) or 0 (neither).

    Ordered ids (the usual case: planned, ``np.unique``-d) take one pass of neighbour
    comparisons, whose branch is always predicted, and an O(1) range check of their
    ends; the min/max pass runs only for unordered ids, which leave the first loop at
    their first step down.
    """
    cdef Py_ssize_t i = 1, n = ids.shape[0]
    order[0] = 2
    if n == 0:
        return -1
    while i < n and ids[i] > ids[i - 1]:
        i += 1
    if i < n:
        order[0] = 1
        while i < n and ids[i] >= ids[i - 1]:
            i += 1
        if i < n:
            order[0] = 0
            return _first_out_of_range(ids, num_rows)
    if ids[0] >= 0 and ids[n - 1] < num_rows:
        return -1
    return _first_out_of_range(ids, num_rows)


def scan_ids(const index_t[::1] ids not None, int64_t num_rows):
    """Return ``(first, order)``: the position of the first id outside ``[0, num_rows)``
    (or -1) and the ids' order, 2 (strictly increasing, so distinct), 1 (non-decreasing)
    or 0 (neither), from one pass with the GIL released.

    Args:
        ids: ``(n,)`` int32 or int64, C-contiguous.
        num_rows: the table's row count.
    """
    cdef Py_ssize_t pos
    cdef int order = 2
    with nogil:
        pos = _scan_ids(ids, num_rows, &order)
    return pos, order


def same_ids(const index_t[::1] a not None, const index_t[::1] b not None):
    """Return True when ``a`` and ``b`` (one dtype, C-contiguous) hold the same ids: one
    ``memcmp`` with the GIL released."""
    cdef Py_ssize_t n = a.shape[0]
    cdef int r = 0
    if b.shape[0] != n:
        return False
    if n:
        with nogil:
            r = memcmp(&a[0], &b[0], n * sizeof(index_t))
    return r == 0


cdef inline Py_ssize_t _first_repeat(const index_t[::1] ids, unsigned char* seen) noexcept nogil:
    """Position of the first id seen before it in ``ids`` (``seen``: a zeroed bitmap)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef int64_t v
    cdef unsigned char bit
    for i in range(n):
        v = ids[i]
        bit = <unsigned char>(1 << (v & 7))
        if seen[v >> 3] & bit:
            return i
        seen[v >> 3] |= bit
    return -1


def first_repeat(const index_t[::1] ids not None, unsigned char[::1] seen not None):
    """Return the position of the first id that already occurred earlier, or -1.

    Args:
        ids: ``(n,)`` int32 or int64, C-contiguous, every id in ``[0, 8 * len(seen))``
            (checked by the caller: an id outside is undefined behaviour).
        seen: a zeroed bitmap of at least ``num_rows / 8`` bytes; it is zeroed again
            before return (only the bytes the ids touched are written), so a caller can
            keep one per thread and skip the page faults of a fresh allocation.
    """
    cdef Py_ssize_t pos, i, end
    cdef int64_t v
    with nogil:
        pos = _first_repeat(ids, &seen[0])
        end = ids.shape[0] if pos < 0 else pos
        for i in range(end):
            v = ids[i]
            seen[v >> 3] = 0
    return pos


cdef inline int _bit_length(uint64_t x) noexcept nogil:
    cdef int b = 0
    while x:
        b += 1
        x >>= 1
    return b


cdef inline void _radix_sort_pairs(uint64_t* keys, int64_t* vals, uint64_t* tmp_keys,
                                   int64_t* tmp_vals, Py_ssize_t k, int key_bits) noexcept nogil:
    """Sort ``keys[:k]`` ascending, carrying ``vals``; result lands in ``keys``/``vals``."""
    cdef Py_ssize_t i, j
    cdef Py_ssize_t count[_RADIX]
    cdef Py_ssize_t total, c
    cdef int shift = 0
    cdef uint64_t d, key
    cdef uint64_t* src_k = keys
    cdef int64_t* src_v = vals
    cdef uint64_t* dst_k = tmp_keys
    cdef int64_t* dst_v = tmp_vals
    cdef uint64_t* swap_k
    cdef int64_t* swap_v
    cdef int64_t v
    if k < 2:
        return
    if k <= 32:
        # insertion sort: cheaper than a radix pass for tiny inputs
        for i in range(1, k):
            key = keys[i]
            v = vals[i]
            j = i - 1
            while j >= 0 and keys[j] > key:
                keys[j + 1] = keys[j]
                vals[j + 1] = vals[j]
                j -= 1
            keys[j + 1] = key
            vals[j + 1] = v
        return
    while shift < key_bits:
        memset(count, 0, sizeof(count))
        for i in range(k):
            count[(src_k[i] >> shift) & (_RADIX - 1)] += 1
        total = 0
        for j in range(_RADIX):
            c = count[j]
            count[j] = total
            total += c
        for i in range(k):
            d = (src_k[i] >> shift) & (_RADIX - 1)
            dst_k[count[d]] = src_k[i]
            dst_v[count[d]] = src_v[i]
            count[d] += 1
        swap_k = src_k; src_k = dst_k; dst_k = swap_k
        swap_v = src_v; src_v = dst_v; dst_v = swap_v
        shift += _RADIX_BITS
    if src_k != keys:
        for i in range(k):
            keys[i] = src_k[i]
            vals[i] = src_v[i]


cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>
    #include <stdint.h>
    /* Per-thread scratch of the planner, reused across calls so that a call does no
       malloc/calloc and touches no fresh pages. cnt[:wcap + 8] and bits[:wcap / 64 + 1]
       are all zero between calls (a call clears only what it touched). */
    typedef struct {
        int32_t *cnt; uint64_t *bits; int64_t wcap;
        uint64_t *a, *b; int64_t *uk, *uc; int64_t ncap;
        int32_t *hist;
    } stp_scratch;
    static pthread_key_t stp_key;
    static pthread_once_t stp_once = PTHREAD_ONCE_INIT;
    static int stp_key_ok = 0;
    static void stp_scratch_free_big(stp_scratch *s) {
        free(s->a); free(s->b); free(s->uk); free(s->uc);
        s->a = s->b = NULL; s->uk = s->uc = NULL; s->ncap = 0;
    }
    static void stp_scratch_free(void *p) {
        stp_scratch *s = (stp_scratch *)p;
        if (!s) return;
        free(s->cnt); free(s->bits); free(s->hist);
        stp_scratch_free_big(s);
        free(s);
    }
    static void stp_make_key(void) { stp_key_ok = pthread_key_create(&stp_key, stp_scratch_free) == 0; }
    /* This thread's scratch with room for a window of w rows and a batch of n ids, or NULL. */
    static stp_scratch *stp_scratch_get(int64_t w, int64_t n) {
        stp_scratch *s;
        int64_t cap;
        pthread_once(&stp_once, stp_make_key);
        if (!stp_key_ok) return NULL;
        s = (stp_scratch *)pthread_getspecific(stp_key);
        if (!s) {
            s = (stp_scratch *)calloc(1, sizeof(stp_scratch));
            if (!s) return NULL;
            s->hist = (int32_t *)malloc(4 * 4096 * sizeof(int32_t));
            if (!s->hist || pthread_setspecific(stp_key, s) != 0) { free(s->hist); free(s); return NULL; }
        }
        if (s->wcap < w) {
            cap = 65536;
            while (cap < w) cap <<= 1;
            free(s->cnt); free(s->bits);
            s->cnt = (int32_t *)calloc((size_t)cap + 8, sizeof(int32_t));
            s->bits = (uint64_t *)calloc((size_t)(cap >> 6) + 1, sizeof(uint64_t));
            s->wcap = (s->cnt && s->bits) ? cap : 0;
            if (!s->wcap) { free(s->cnt); free(s->bits); s->cnt = NULL; s->bits = NULL; return NULL; }
        }
        if (s->ncap < n) {
            cap = 1024;
            while (cap < n) cap <<= 1;
            stp_scratch_free_big(s);
            s->a = (uint64_t *)malloc((size_t)cap * sizeof(uint64_t));
            s->b = (uint64_t *)malloc((size_t)cap * sizeof(uint64_t));
            s->uk = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
            s->uc = (int64_t *)malloc((size_t)cap * sizeof(int64_t));
            if (!s->a || !s->b || !s->uk || !s->uc) { stp_scratch_free_big(s); return NULL; }
            s->ncap = cap;
        }
        return s;
    }
    /* Batches above this many ids give their (n,) buffers back after the call. */
    #define STP_KEEP_IDS ((int64_t)1 << 20)
    static void stp_scratch_trim(stp_scratch *s) { if (s->ncap > STP_KEEP_IDS) stp_scratch_free_big(s); }
    #define stp_ctz64(x) __builtin_ctzll(x)
    #define stp_clz64(x) __builtin_clzll(x)
    """
    ctypedef struct stp_scratch:
        int32_t* cnt
        uint64_t* bits
        int64_t wcap
        uint64_t* a
        uint64_t* b
        int64_t* uk
        int64_t* uc
        int64_t ncap
        int32_t* hist
    stp_scratch* stp_scratch_get(int64_t w, int64_t n) noexcept nogil
    void stp_scratch_trim(stp_scratch* s) noexcept nogil
    int stp_ctz64(uint64_t x) noexcept nogil
    int stp_clz64(uint64_t x) noexcept nogil


cdef inline Py_ssize_t _radix_emit(uint64_t* a, uint64_t* b, Py_ssize_t m, int32_t* hist,
                                   int pos_bits, int key_bits, int64_t* uniq, int64_t* inverse,
                                   int64_t* counts, Py_ssize_t k) noexcept nogil:
    """LSD-sort the ``m`` packed words ``id << pos_bits | position`` in ``a`` on their
    ``key_bits`` id bits, then append their distinct ids to ``uniq``/``counts`` from slot
    ``k`` on and write ``inverse`` at their positions. ``b`` is ``(m,)`` scratch; ``hist``
    holds ``4 * 4096`` counters. Returns the new number of distinct ids."""
    cdef Py_ssize_t i, j
    cdef int32_t total, c
    cdef int passes, digit, shift, p, max_digit
    cdef Py_ssize_t buckets
    cdef uint64_t w, pos_mask = (<uint64_t>1 << pos_bits) - 1, d, dmask
    cdef uint64_t* src = a
    cdef uint64_t* dst = b
    cdef uint64_t* swap
    cdef int32_t* h
    cdef int64_t key, prev
    cdef Py_ssize_t start = 0
    if m == 0:
        return k
    # few wide passes for big inputs, narrow cache-friendly digits for small ones
    max_digit = 12 if m >= 4096 else 8
    passes = (key_bits + max_digit - 1) // max_digit
    if passes < 1:
        passes = 1
    digit = (key_bits + passes - 1) // passes
    if digit < 1:
        digit = 1
    buckets = (<Py_ssize_t>1) << digit
    dmask = <uint64_t>(buckets - 1)
    memset(hist, 0, passes * buckets * sizeof(int32_t))
    # one read fills every pass's histogram
    if passes == 1:
        for i in range(m):
            hist[(a[i] >> pos_bits) & dmask] += 1
    elif passes == 2:
        for i in range(m):
            w = a[i] >> pos_bits
            hist[w & dmask] += 1
            hist[buckets + ((w >> digit) & dmask)] += 1
    elif passes == 3:
        for i in range(m):
            w = a[i] >> pos_bits
            hist[w & dmask] += 1
            hist[buckets + ((w >> digit) & dmask)] += 1
            hist[2 * buckets + ((w >> (2 * digit)) & dmask)] += 1
    else:
        for i in range(m):
            w = a[i] >> pos_bits
            for p in range(passes):
                hist[p * buckets + ((w >> (p * digit)) & dmask)] += 1
    for p in range(passes):
        h = hist + p * buckets
        shift = pos_bits + p * digit
        if h[(src[0] >> shift) & dmask] == m:
            continue  # every word has the same digit here: the pass would move nothing
        total = 0
        for j in range(buckets):
            c = h[j]
            h[j] = total
            total += c
        for i in range(m):
            w = src[i]
            d = (w >> shift) & dmask
            dst[h[d]] = w
            h[d] += 1
        swap = src; src = dst; dst = swap
    # runs of equal ids: the count of a run is written once, when it ends
    prev = <int64_t>(src[0] >> pos_bits)
    for i in range(m):
        w = src[i]
        key = <int64_t>(w >> pos_bits)
        if key != prev:
            uniq[k] = prev
            counts[k] = i - start
            k += 1
            start = i
            prev = key
        inverse[w & pos_mask] = k
    uniq[k] = prev
    counts[k] = m - start
    return k + 1


cdef inline Py_ssize_t _plan_window(const index_t[::1] ids, uint64_t window, uint64_t num_rows,
                                    int64_t* uniq, int64_t* inverse, int64_t* counts,
                                    int32_t* cnt, uint64_t* bits, uint64_t* a, uint64_t* b,
                                    int32_t* hist, int pos_bits) noexcept nogil:
    """Counting plan for ids below ``window`` plus radix plan for the rest; range check.

    ``cnt`` (``(window + 8,)`` int32) and ``bits`` (one bit per window row) are zero on
    entry and on return. Ids below the window (the hot ids of skewed batches: Zipf ranks,
    frequency-sorted vocabularies) cost one cache-resident increment each, and the first
    one of each row marks it in ``bits``, so only the marked rows are visited (in order)
    to number them; the rest are packed into ``a`` and radix sorted on as many bits as
    their largest id has. Window ids all sort before the others, so the two parts
    concatenate in order. The range check rides along: window ids are valid by
    construction, the others (negative ones included, as unsigned) must stay below
    ``num_rows``. Returns the number of distinct ids, or -1 (nothing planned, scratch
    clean) when an id is out of range.
    """
    cdef Py_ssize_t i, n = ids.shape[0], k = 0, m = 0, nw, wi, j, nf = 0
    cdef uint64_t v, hi = 0, word, idx
    cdef int inside
    cdef int32_t c
    cdef int64_t r
    cdef int key_bits
    if window:
        # branch-free (skewed batches mix both sides unpredictably): ids outside the
        # window add 0 to one of 8 spare counters past it (spread so that their stores
        # do not chain), and are written to ``a`` where only an outside id advances ``m``;
        # a window row seen for the first time is noted in ``uniq``, marked in ``bits``
        # afterwards
        for i in range(n):
            v = <uint64_t>ids[i]
            inside = v < window
            idx = v if inside else window + (<uint64_t>i & 7)
            c = cnt[idx]
            cnt[idx] = c + inside
            uniq[nf] = <int64_t>v
            nf += (c == 0) & inside
            a[m] = (v << pos_bits) | <uint64_t>i
            m += 1 - inside
            v = 0 if inside else v
            hi = v if v > hi else hi
        for j in range(nf):
            v = <uint64_t>uniq[j]
            bits[v >> 6] |= (<uint64_t>1) << (v & 63)
    else:
        for i in range(n):
            v = <uint64_t>ids[i]
            a[i] = (v << pos_bits) | <uint64_t>i
            hi = v if v > hi else hi
        m = n
    nw = <Py_ssize_t>((window + 63) >> 6)
    if hi >= num_rows:
        # a bad id: leave the scratch as we found it
        if m < n:
            for wi in range(nw):
                word = bits[wi]
                if word:
                    bits[wi] = 0
                    while word:
                        cnt[(wi << 6) + stp_ctz64(word)] = 0
                        word &= word - 1
        return -1
    if m < n:
        # number the marked window rows in order; cnt[r] becomes r's slot in uniq
        for wi in range(nw):
            word = bits[wi]
            if word:
                bits[wi] = 0
                while word:
                    r = (wi << 6) + stp_ctz64(word)
                    uniq[k] = r
                    counts[k] = cnt[r]
                    cnt[r] = <int32_t>k
                    k += 1
                    word &= word - 1
        if m == 0:
            for i in range(n):
                inverse[i] = cnt[ids[i]]
        else:
            # branch-free: outside ids read the zero at cnt[window]; the radix part
            # overwrites their slots
            for i in range(n):
                v = <uint64_t>ids[i]
                inverse[i] = cnt[v if v < window else window]
        for j in range(k):
            cnt[uniq[j]] = 0
    key_bits = 64 - stp_clz64(hi) if hi else 1
    return _radix_emit(a, b, m, hist, pos_bits, key_bits, uniq, inverse, counts, k)


cdef inline Py_ssize_t _plan_hash(const index_t[::1] ids, int64_t num_rows, int64_t* uniq,
                                  int64_t* inverse, int64_t* counts, int64_t* slot_keys,
                                  int64_t* slot_order, uint64_t* sort_keys, int64_t* sort_vals,
                                  uint64_t* tmp_keys, int64_t* tmp_vals, int64_t* rank,
                                  int cap_bits) noexcept nogil:
    """Hash plan. ``slot_keys`` is a ``(2**cap_bits,)`` array filled with -1; scratch
    arrays are ``(n,)`` long. ``inverse`` first holds insertion numbers, then ranks."""
    cdef Py_ssize_t i, n = ids.shape[0], k = 0
    cdef uint64_t mask = (<uint64_t>1 << cap_bits) - 1
    cdef int shift = 64 - cap_bits
    cdef uint64_t h
    cdef int64_t key, ins
    for i in range(n):
        key = ids[i]
        h = (<uint64_t>key * <uint64_t>0x9E3779B97F4A7C15ULL) >> shift
        while True:
            if slot_keys[h] == key:
                ins = slot_order[h]
                break
            if slot_keys[h] == -1:
                slot_keys[h] = key
                slot_order[h] = k
                sort_keys[k] = <uint64_t>key
                sort_vals[k] = k
                tmp_vals[k] = 0  # tmp_vals doubles as the per-insertion count until the sort
                ins = k
                k += 1
                break
            h = (h + 1) & mask
        inverse[i] = ins
        tmp_vals[ins] += 1
    # counts in insertion order are parked in counts[] before tmp_vals is reused by the sort
    for i in range(k):
        counts[i] = tmp_vals[i]
    _radix_sort_pairs(sort_keys, sort_vals, tmp_keys, tmp_vals, k,
                      _bit_length(<uint64_t>(num_rows - 1)))
    for i in range(k):
        uniq[i] = <int64_t>sort_keys[i]
        rank[sort_vals[i]] = i
    # counts: permute from insertion order to sorted order (tmp_vals is free again)
    for i in range(k):
        tmp_vals[i] = counts[sort_vals[i]]
    for i in range(k):
        counts[i] = tmp_vals[i]
    for i in range(n):
        inverse[i] = rank[inverse[i]]
    return k


cdef enum:
    # counting window (rows) when the table is large against the batch: its int32
    # counters fill 32 KB, an L1 data cache. A wider window counts a few more ids of a
    # skewed batch but scatters their increments over more lines: 2**16 rows (256 KB)
    # was slower in every case measured (2-core VM, paired calls, RESULTS.md "Planner"),
    # by 18 us hot and 146 us with cold caches for a 34,816-id Zipf(1.2) batch
    _WINDOW = 8192


cdef object _plan(const index_t[::1] ids, int64_t num_rows, bint check):
    """Shared body of :func:`plan_unchecked` and :func:`plan_checked`."""
    cdef Py_ssize_t n = ids.shape[0]
    cdef Py_ssize_t k = 0, cap = 16, bad = -1
    cdef int cap_bits = 4
    # counting window: the whole table when it is small against the batch, else _WINDOW
    # rows (none for batches too long for int32 counters)
    cdef int64_t window = num_rows if num_rows <= (4 * n if 4 * n > _WINDOW else _WINDOW) else _WINDOW
    cdef int pos_bits = _bit_length(<uint64_t>(n - 1)) if n > 1 else 1
    cdef int key_bits = _bit_length(<uint64_t>(num_rows - 1)) if num_rows > 1 else 1
    cdef int64_t[::1] inverse
    cdef int64_t[::1] uniq
    cdef int64_t[::1] counts
    cdef stp_scratch* s = NULL
    cdef int64_t* rank = NULL
    cdef int64_t* slot_keys = NULL
    cdef int64_t* slot_order = NULL
    cdef uint64_t* sort_keys = NULL
    cdef int64_t* sort_vals = NULL
    cdef uint64_t* tmp_keys = NULL
    cdef int64_t* tmp_vals = NULL
    cdef int64_t* uk
    cdef int64_t* uc
    cdef bint failed = False
    if n == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    if n > 2147483647:
        window = 0
    inverse_arr = np.empty(n, dtype=np.int64)
    inverse = inverse_arr
    if pos_bits + key_bits <= 64:
        with nogil:
            s = stp_scratch_get(window, n)
            if s == NULL:
                failed = True
            else:
                # an unchecked call passes no bound: its ids are valid by contract
                k = _plan_window(ids, <uint64_t>window,
                                 <uint64_t>num_rows if check else <uint64_t>(-1),
                                 s.uk, &inverse[0], s.uc, s.cnt, s.bits, s.a, s.b, s.hist,
                                 pos_bits)
                if k < 0:
                    bad = _first_out_of_range(ids, num_rows)
        if bad >= 0:
            return bad
        if failed:
            raise MemoryError(f"stpipe planner: could not allocate scratch memory for {n} ids")
        uniq_arr = np.empty(k, dtype=np.int64)
        counts_arr = np.empty(k, dtype=np.int64)
        uniq = uniq_arr
        counts = counts_arr
        with nogil:
            memcpy(&uniq[0], s.uk, k * sizeof(int64_t))
            memcpy(&counts[0], s.uc, k * sizeof(int64_t))
            stp_scratch_trim(s)
        return uniq_arr, inverse_arr, counts_arr
    uniq_arr = np.empty(n, dtype=np.int64)
    counts_arr = np.empty(n, dtype=np.int64)
    uniq = uniq_arr
    counts = counts_arr
    with nogil:
        if check:
            bad = _first_out_of_range(ids, num_rows)
        if bad < 0:
            while cap < 2 * n:
                cap <<= 1
                cap_bits += 1
            slot_keys = <int64_t*>malloc(cap * sizeof(int64_t))
            slot_order = <int64_t*>malloc(cap * sizeof(int64_t))
            sort_keys = <uint64_t*>malloc(n * sizeof(uint64_t))
            sort_vals = <int64_t*>malloc(n * sizeof(int64_t))
            tmp_keys = <uint64_t*>malloc(n * sizeof(uint64_t))
            tmp_vals = <int64_t*>malloc(n * sizeof(int64_t))
            rank = <int64_t*>malloc(n * sizeof(int64_t))
            if (slot_keys == NULL or slot_order == NULL or sort_keys == NULL or sort_vals == NULL
                    or tmp_keys == NULL or tmp_vals == NULL or rank == NULL):
                failed = True
            else:
                memset(slot_keys, 0xFF, cap * sizeof(int64_t))  # all -1
                k = _plan_hash(ids, num_rows, &uniq[0], &inverse[0], &counts[0], slot_keys,
                               slot_order, sort_keys, sort_vals, tmp_keys, tmp_vals, rank,
                               cap_bits)
            free(rank)
            free(slot_keys)
            free(slot_order)
            free(sort_keys)
            free(sort_vals)
            free(tmp_keys)
            free(tmp_vals)
    if bad >= 0:
        return bad
    if failed:
        raise MemoryError(f"stpipe planner: could not allocate scratch memory for {n} ids")
    return uniq_arr[:k].copy(), inverse_arr, counts_arr[:k].copy()


def plan_unchecked(const index_t[::1] ids not None, int64_t num_rows):
    """Deduplicate and sort one batch of already validated ids.

    Args:
        ids: ``(n,)`` int32 or int64, C-contiguous, every value in ``[0, num_rows)``.
        num_rows: the table's row count (> 0).

    Returns:
        ``(unique, inverse, counts)``: ``(k,)`` int64 sorted distinct ids, ``(n,)`` int64
        positions into ``unique``, ``(k,)`` int64 occurrence counts.
    """
    return _plan(ids, num_rows, False)


def plan_checked(const index_t[::1] ids not None, int64_t num_rows):
    """Range-check then plan one batch, in one call (what :func:`stpipe.planner.plan` uses).

    Args:
        ids: ``(n,)`` int32 or int64, C-contiguous.
        num_rows: the table's row count (> 0).

    Returns:
        ``(unique, inverse, counts)`` as :func:`plan_unchecked`, or, when an id lies
        outside ``[0, num_rows)``, the position (an int) of the first such id.
    """
    return _plan(ids, num_rows, True)


cdef inline Py_ssize_t _intersect(const int64_t[::1] a, const int64_t[::1] b, int64_t* pa,
                                  int64_t* pb) noexcept nogil:
    """Sorted-merge intersection, branch-free: which side advances depends on the data
    (a mispredicted branch per step in a three-way ``if``), so each step writes both
    positions, keeps them only on a match, and advances each side by a comparison
    result (two 8,046-id Zipf plans on the 2-core VM: 42 us against 55 us for the
    branching merge, the ``overlap`` call included)."""
    cdef Py_ssize_t i = 0, j = 0, m = 0, na = a.shape[0], nb = b.shape[0]
    cdef int64_t x, y
    # the unconditional writes stay in bounds: m < min(na, nb) while both sides have
    # ids left, since every match uses one id of each
    while i < na and j < nb:
        x = a[i]
        y = b[j]
        pa[m] = i
        pb[m] = j
        m += x == y
        i += x <= y
        j += y <= x
    return m


def intersect_sorted(const int64_t[::1] a not None, const int64_t[::1] b not None):
    """Positions of the values two sorted, duplicate-free int64 arrays share.

    Returns:
        ``(pos_a, pos_b)``: ``(m,)`` int64 each, with ``a[pos_a] == b[pos_b]``, ascending.
    """
    cdef Py_ssize_t cap = a.shape[0] if a.shape[0] < b.shape[0] else b.shape[0]
    pa_arr = np.empty(cap, dtype=np.int64)
    pb_arr = np.empty(cap, dtype=np.int64)
    cdef int64_t[::1] pa = pa_arr
    cdef int64_t[::1] pb = pb_arr
    cdef Py_ssize_t m = 0
    if cap == 0:
        return pa_arr, pb_arr
    with nogil:
        m = _intersect(a, b, &pa[0], &pb[0])
    return pa_arr[:m].copy(), pb_arr[:m].copy()
