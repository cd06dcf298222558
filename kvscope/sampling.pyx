# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False
"""Spatial sampling of block hashes: the one predicate the vLLM tap samples with and the
analysis scales by (SHARDS: Waldspurger, Park, Garthwaite & Ahmad, "Efficient MRC Construction
with SHARDS", USENIX FAST 2015, section 3).

A block, named by a 64-bit key, is sampled iff ``spatial_hash(key) < T`` with ``T`` in
``[1, MODULUS]``: the sampling rate is ``R = T / MODULUS``. Every access to a sampled block is
kept, so the sampled stream is a miniature of the whole: a stack distance ``d`` in it stands for
``d / R`` in the full stream, and its miss-ratio curve, scaled so, estimates the full one.
Nested rates nest: with one seed, the blocks sampled at ``R2 < R1`` are a subset of those at
``R1``, so a sample taken at ``R1`` (a tap's capture) can be sampled again at ``R2`` as if
from the full stream.

The hash is MurmurHash3's 64-bit finalizer (Appleby, ``fmix64``) of the key xor a seed, plus
SplitMix64's odd increment first (Steele, Lea & Flood, OOPSLA 2014) so that key 0 (often the
hottest block: a shared first block) is not always sampled; its top 32 bits
(``MODULUS = 2**32``). A key is an unsigned 64-bit integer: an engine's integer block hash
reduced mod 2**64, or the first 8 bytes, little-endian, of a bytes block hash (vLLM's
``BlockHash``: a SHA-256 digest by default, 32 bytes; a shorter one is zero-padded).

Compiled, because the tap applies the predicate to every block of every prompt on vLLM's
scheduler thread: about 20 ns a block here against 1.2 us written in Python
(bench/tap_overhead.py). Imports only the standard library (the in-engine taps import it).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from libc.stdint cimport int64_t, uint64_t

MODULUS = 1 << 32  # P: thresholds T are integers in [1, P]
# The vLLM tap's default rate (kvscope_block_sample_rate): 1 block in 16. At it the sampled
# curve of tests/analysis/test_block_sampling.py's 2M-access stream is within 0.01 (mean absolute
# error) of the exact one, and a capture holds a sixteenth of the rows.
DEFAULT_RATE = 1.0 / 16
MAX_SAMPLED_PER_LOOKUP = 4096  # sampled blocks one lookup may carry (the rest dropped, counted)

cdef uint64_t _MASK = 0xFFFFFFFFFFFFFFFF


cdef inline uint64_t _mix(uint64_t key, uint64_t seed) noexcept nogil:
    cdef uint64_t x = (key ^ seed) + <uint64_t>0x9E3779B97F4A7C15
    x ^= x >> 33
    x *= <uint64_t>0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= <uint64_t>0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x >> 32


def threshold(double rate):
    """``T`` for a sampling ``rate`` (0 < rate <= 1): ``round(rate * MODULUS)``, at least 1.
    Raises ValueError for a rate outside (0, 1]."""
    if not 0 < rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
    return max(1, round(rate * MODULUS))


def rate_of(t):
    """The rate (0-1) a threshold ``T`` samples at: ``T / MODULUS`` (exact in a float64)."""
    return t / MODULUS


cdef inline uint64_t _key(object block_hash) except? 0:
    cdef const unsigned char *data
    cdef Py_ssize_t size, i
    cdef uint64_t key = 0
    if type(block_hash) is bytes:
        data = <const unsigned char *>PyBytes_AS_STRING(block_hash)
        size = PyBytes_GET_SIZE(block_hash)
        if size >= 8:  # the usual case (a 32-byte SHA-256 digest): one load, little-endian
            for i in range(8):
                key |= (<uint64_t>data[i]) << (8 * i)
            return key
        for i in range(size):
            key |= (<uint64_t>data[i]) << (8 * i)
        return key
    return <uint64_t>(block_hash & _MASK)


def key_of(block_hash):
    """The 64-bit key of an engine's block hash (bytes or int; see the module docstring)."""
    return _key(block_hash)


def spatial_hash(key, seed=0):
    """The spatial hash of one 64-bit ``key`` (an int, reduced mod 2**64) in ``[0, MODULUS)``."""
    return _mix(<uint64_t>(key & _MASK), <uint64_t>(seed & _MASK))


def hash_array(const uint64_t[::1] keys, seed, int64_t[::1] out):
    """``out[i] = spatial_hash(keys[i], seed)`` for every key (arrays of equal length; numpy's
    uint64 and int64). Raises ValueError for arrays of different lengths."""
    cdef Py_ssize_t i, n = keys.shape[0]
    cdef uint64_t s = <uint64_t>(seed & _MASK)
    if out.shape[0] != n:
        raise ValueError(f"hash_array: {n} keys, {out.shape[0]} outputs")
    with nogil:
        for i in range(n):
            out[i] = <int64_t>_mix(keys[i], s)


def sample(hashes, Py_ssize_t blocks, t, Py_ssize_t cap=MAX_SAMPLED_PER_LOOKUP):
    """The sampled blocks among the first ``blocks`` of ``hashes`` (a list of an engine's block
    hashes, bytes or int), seed 0, threshold ``t``: ``(keys, depths, dropped)``, the sampled
    blocks' 64-bit keys and positions (0 = first), in order, at most ``cap`` of them, and how
    many more were sampled beyond ``cap``. Raises what indexing ``hashes`` raises (TypeError for
    a hash neither bytes nor int)."""
    cdef Py_ssize_t i, n, kept = 0, dropped = 0
    cdef uint64_t key, limit = <uint64_t>t
    cdef list keys = [], depths = [], items
    # vLLM's block_hashes is a list: read it without a reference count per item
    items = hashes if type(hashes) is list else list(hashes)
    n = min(blocks, PyList_GET_SIZE(items))
    for i in range(n):
        key = _key(<object>PyList_GET_ITEM(items, i))
        if _mix(key, 0) < limit:
            if kept < cap:
                keys.append(key)
                depths.append(i)
                kept += 1
            else:
                dropped += 1
    return keys, depths, dropped
