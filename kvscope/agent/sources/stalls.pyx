# cython: language_level=3, embedsignature=True
"""Telling, without the GIL, when ingest's folding thread is held up while messages wait.

The folding thread counts the batches it takes (:meth:`Progress.took`) and names itself
(:meth:`Progress.attach`); the watcher thread waits in :meth:`Progress.held_up` on the socket's
notification descriptor, that count and the folding thread's CPU clock, holding no GIL. A
folding thread that takes no batch and uses no CPU is waiting (a lock, I/O, a subscriber's
sleep): only then does the watcher take the GIL, so that watching costs a busy agent nothing (a
watcher that took the GIL at each message cost ingest a tenth of its time).
"""

from libc.stdint cimport uint64_t


cdef extern from *:
    """
    #include <poll.h>
    #include <pthread.h>
    #include <time.h>
    static uint64_t kv_load(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static void kv_add(uint64_t *p) { __atomic_add_fetch(p, 1, __ATOMIC_RELEASE); }
    static int kv_readable(int fd, int milliseconds) {
        struct pollfd watched = {fd, POLLIN, 0};
        return poll(&watched, 1, milliseconds) > 0;
    }
    static void kv_sleep(double seconds) {
        struct timespec t = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
        nanosleep(&t, NULL);
    }
    /* the calling thread's CPU clock, for another thread to read */
    static int kv_own_clock(clockid_t *clock) {
        return pthread_getcpuclockid(pthread_self(), clock);
    }
    static double kv_cpu_seconds(clockid_t clock) {
        struct timespec t;
        if (clock_gettime(clock, &t)) return -1.0;
        return t.tv_sec + t.tv_nsec * 1e-9;
    }
    """
    ctypedef int clockid_t
    uint64_t kv_load(uint64_t *p) nogil
    void kv_add(uint64_t *p) nogil
    int kv_readable(int fd, int milliseconds) nogil
    void kv_sleep(double seconds) nogil
    int kv_own_clock(clockid_t *clock) nogil
    double kv_cpu_seconds(clockid_t clock) nogil


cdef class Progress:
    """Batches the folding thread took, and its CPU clock; :meth:`held_up` waits for it to be
    held up."""

    cdef uint64_t _taken
    cdef uint64_t _stopped
    cdef clockid_t _clock
    cdef bint _attached

    def attach(self):
        """Name the calling thread as the folding one (its CPU time tells it is busy).

        Raises OSError when the system gives no thread CPU clock."""
        if kv_own_clock(&self._clock):
            raise OSError("no CPU clock for the folding thread")
        self._attached = True

    def took(self):
        """Count one batch taken (the folding thread)."""
        kv_add(&self._taken)

    def stop(self):
        """Make :meth:`held_up` return False."""
        kv_add(&self._stopped)

    @property
    def taken(self):
        return kv_load(&self._taken)

    def readable(self, int descriptor, double seconds):
        """Whether ``descriptor`` becomes readable within ``seconds`` (waited without the GIL;
        poll(2), so any descriptor number)."""
        cdef int milliseconds = <int>(seconds * 1000) or 1
        cdef int ready
        with nogil:
            ready = kv_readable(descriptor, milliseconds)
        return bool(ready)

    def held_up(self, int descriptor, double stall):
        """Wait, without the GIL, until a message waits (``descriptor``, the socket's ZMQ_FD,
        is readable) while the folding thread has taken no batch and used under half of
        ``stall`` seconds of CPU in the last ``stall`` seconds: True then; False once
        :meth:`stop` was called (within 0.1 s)."""
        cdef uint64_t seen
        cdef double busy
        if not self._attached:
            raise RuntimeError("attach() the folding thread first")
        with nogil:
            while not kv_load(&self._stopped):
                if not kv_readable(descriptor, 100):
                    continue
                seen, busy = kv_load(&self._taken), kv_cpu_seconds(self._clock)
                kv_sleep(stall)
                if (kv_load(&self._taken) == seen
                        and kv_cpu_seconds(self._clock) - busy < stall / 2):
                    break
                kv_sleep(stall)  # busy: the descriptor stays readable until it receives
        return not kv_load(&self._stopped)
