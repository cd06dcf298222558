# The C fields of vllm_manager.py's _Observer (Cython's pure-Python mode: this file types the
# .py's class when setup.py compiles it; the .py alone runs as it is).

cdef class _Observer:
    cdef readonly object inner
    cdef readonly bint multi_tier
    cdef readonly Py_ssize_t errors, unattributed, unseen_evictions, sampled_blocks_dropped
    cdef readonly dict _resident
    cdef object _emit, _clock, _block_t, _unmeasured_lock
    cdef double _block_rate, _interval, _unmeasured_at, _next_snapshot, _refresh_at
    cdef Py_ssize_t _tpb, _bpc, _block_bytes, _capacity, _max_requests, _one_in, _chunks
    cdef Py_ssize_t _stored, _skipped, _store_failed, _max_tracked, _reported
    cdef bint _took_events
    cdef object _reqs  # an OrderedDict: drops its oldest in O(1), a dict's first slot may not
    cdef dict _consulted, _awaiting_first, _hits, _last_hit, _unmeasured
    cdef dict _unmeasured_sent, _promoting
    cdef tuple _admissions_sent
    cdef set _below, _promoted_at_reset
    cdef list _held

    cdef _failed(self, where, exc)
    cdef _sampled_lookup(self, request, now, rid, tokens, blocks, hits, local, cached, tiers)
    cdef _dropped_blocks(self, n)
    cdef _forget_oldest(self)
    cdef _declined(self, keys, req_context)
    cdef _finished(self, rid)
    cdef _evict(self, keys, tier, reason, now)
    cdef _release(self, stored_below)
    cdef _unmeasure(self, reason, chunks)
    cdef _send_unmeasured(self, now)
    cdef _evictions(self, tier, reason, now, stored, hits, lasts, offloaded, weight=*)
    cdef _eviction(self, now, tier, reason, hits, chunks, age, offloaded, measured, weight, idle)
    cdef _manager_events(self, events)
    cdef _untimed(self, src, dst, chunks, now, request_id=*)
    cdef _snapshot(self, now, force=*)
