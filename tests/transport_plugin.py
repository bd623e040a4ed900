"""Drives jaxgin's host transport the way NCCL's GIN proxy does, through its RMA plugin table
(ncclRmaPlugin_v14), with ctypes: the CPU tests use host-memory regions, so no GPU is needed.

Run as a script it is one rank of a multi-process scenario (tests/test_transport.py starts them):
    python tests/transport_plugin.py LIBRARY DIR RANK NRANKS SCENARIO
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char_p,
    c_float,
    c_int,
    c_int16,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

import numpy as np

SUCCESS, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 0, 4, 5, 6
PTR_HOST, PTR_CUDA = 1, 2
SIGNAL_INC, SIGNAL_ADD = 1, 2
NEVER_RESET = 2
HANDLE_BYTES = 128


class Properties(Structure):
    _fields_ = [
        ("name", c_char_p), ("pciPath", c_char_p), ("guid", c_uint64), ("ptrSupport", c_int),
        ("regIsGlobal", c_int), ("forceFlush", c_int), ("speed", c_int), ("port", c_int), ("latency", c_float),
        ("maxComms", c_int), ("maxRecvs", c_int), ("netDeviceType", c_int), ("netDeviceVersion", c_int),
        ("vndevs", c_int), ("vdevs", c_int * 8), ("maxP2pBytes", c_size_t), ("maxCollBytes", c_size_t),
        ("maxMultiRequestSize", c_int), ("railId", c_int16), ("planeId", c_int16),
    ]


class Config(Structure):
    _fields_ = [("nContexts", c_int), ("trafficClass", c_int), ("rankStride", c_int)]


P = c_void_p
PP = POINTER(c_void_p)
_TABLE = [
    ("name", c_char_p),
    ("init", CFUNCTYPE(c_int, PP, c_uint64, c_void_p)),
    ("devices", CFUNCTYPE(c_int, POINTER(c_int))),
    ("getProperties", CFUNCTYPE(c_int, c_int, POINTER(Properties))),
    ("listen", CFUNCTYPE(c_int, P, c_int, P, PP)),
    ("connect", CFUNCTYPE(c_int, P, PP, c_int, c_int, P, PP)),
    ("createContext", CFUNCTYPE(c_int, P, POINTER(Config), PP)),
    ("regMrSym", CFUNCTYPE(c_int, P, P, c_size_t, c_int, c_uint64, PP)),
    ("regMrSymDmaBuf", CFUNCTYPE(c_int, P, P, c_size_t, c_int, c_uint64, c_int, c_uint64, PP)),
    ("deregMrSym", CFUNCTYPE(c_int, P, P)),
    ("destroyContext", CFUNCTYPE(c_int, P)),
    ("closeColl", CFUNCTYPE(c_int, P)),
    ("closeListen", CFUNCTYPE(c_int, P)),
    ("iput", CFUNCTYPE(c_int, P, c_int, c_uint64, P, c_size_t, c_uint64, P, c_uint32, PP)),
    ("iputSignal", CFUNCTYPE(c_int, P, c_int, c_uint64, P, c_size_t, c_uint64, P, c_uint32, c_uint64, P, c_uint64,
                             c_uint32, c_bool, PP)),
    ("iget", CFUNCTYPE(c_int, P, c_int, c_uint64, P, c_size_t, c_uint64, P, c_uint32, PP)),
    ("iflush", CFUNCTYPE(c_int, P, c_int, P, c_uint32, PP)),
    ("test", CFUNCTYPE(c_int, P, P, POINTER(c_int))),
    ("rmaProgress", CFUNCTYPE(c_int, P)),
    ("queryLastError", CFUNCTYPE(c_int, P, POINTER(c_bool))),
    ("finalize", CFUNCTYPE(c_int, P)),
]


class PluginTable(Structure):
    _fields_ = _TABLE


def load(library: str | Path) -> PluginTable:
    lib = ctypes.CDLL(str(library))
    return PluginTable.in_dll(lib, "ncclRmaPlugin_v14")


class TransportError(RuntimeError):
    def __init__(self, what: str, code: int):
        super().__init__(f"{what} returned {code}")
        self.code = code


def check(code: int, what: str) -> None:
    if code != SUCCESS:
        raise TransportError(what, code)


# NCCL's logger: (level, subsystems, file, line, format, ...); the plugin's one variadic argument
# is its message (format "jaxgin transport: %s").
LOGGER = CFUNCTYPE(None, c_int, c_uint64, c_char_p, c_int, c_char_p, c_char_p)


class Rank:
    """One rank's view: its plugin context, listener, communicator and RMA context. `log` receives
    (level, message) for every line the plugin gives NCCL's logger."""

    def __init__(self, table: PluginTable, contexts: int = 2, log=None):
        self.t = table
        self.contexts = contexts
        self.ctx = c_void_p()
        self.logger = LOGGER(lambda level, flags, file, line, fmt, text: log(level, text.decode())) if log else None
        check(table.init(ctypes.byref(self.ctx), 1234, ctypes.cast(self.logger, c_void_p) if log else None), "init")
        self.handle = ctypes.create_string_buffer(HANDLE_BYTES)
        self.listener = c_void_p()
        check(table.listen(self.ctx, 0, self.handle, ctypes.byref(self.listener)), "listen")
        self.comm = c_void_p()
        self.rma = c_void_p()
        self.keep = []  # arrays registered with the plugin must outlive it
        # NCCL (2.32) hands connect() its NET plugin's context, not the one init() made here: pass
        # something else too, whose words are no pointers a plugin could follow.
        self.foreign = (c_uint64 * 4)(0xDEAD0001, 0xDEAD0002, 0xDEAD0003, 0xDEAD0004)

    def connect(self, handles: list[bytes], rank: int) -> None:
        self.rank, self.nranks = rank, len(handles)
        buffers = [ctypes.create_string_buffer(h, HANDLE_BYTES) for h in handles]
        array = (c_void_p * len(handles))(*[ctypes.cast(b, c_void_p) for b in buffers])
        check(self.t.connect(ctypes.cast(self.foreign, c_void_p), array, len(handles), rank, self.listener,
                             ctypes.byref(self.comm)), "connect")
        config = Config(self.contexts, -1, 1)
        check(self.t.createContext(self.comm, ctypes.byref(config), ctypes.byref(self.rma)), "createContext")

    def register(self, array: np.ndarray, flags: int = 0, kind: int = PTR_HOST) -> c_void_p:
        """`kind` PTR_CUDA registers host memory as device memory: only for the library built
        against csrc/transport/fake_cuda.cc, whose "device memory" is host memory."""
        handle = c_void_p()
        self.keep.append(array)
        check(self.t.regMrSym(self.comm, array.ctypes.data, array.nbytes, kind, flags, ctypes.byref(handle)),
              "regMrSym")
        return handle

    def put(self, src, src_off, size, dst, dst_off, peer, *, signal=None, signal_off=0, value=1, op=SIGNAL_ADD,
            context=0, strong=True):
        """A put (iput), or with `signal` a put with a signal (iputSignal), strong (it settles every
        earlier put of its context to `peer`) or weak (only its own)."""
        request = c_void_p()
        if signal is None:
            code = self.t.iput(self.rma, context, src_off, src, size, dst_off, dst, peer, ctypes.byref(request))
        else:
            code = self.t.iputSignal(self.rma, context, src_off, src, size, dst_off, dst, peer, signal_off, signal,
                                     value, op, strong, ctypes.byref(request))
        check(code, "iputSignal" if signal is not None else "iput")
        return request

    def wait(self, request, timeout: float = 30.0) -> None:
        done = c_int(0)
        deadline = time.monotonic() + timeout
        while not done.value:
            check(self.t.test(self.comm, request, ctypes.byref(done)), "test")
            if time.monotonic() > deadline:
                raise TimeoutError("a transport request did not complete")

    def progress(self) -> None:
        check(self.t.rmaProgress(self.rma), "rmaProgress")

    def has_error(self) -> bool:
        flag = c_bool(False)
        check(self.t.queryLastError(self.rma, ctypes.byref(flag)), "queryLastError")
        return flag.value

    def close(self) -> None:
        if self.rma:
            check(self.t.destroyContext(self.rma), "destroyContext")
        if self.comm:
            check(self.t.closeColl(self.comm), "closeColl")
        check(self.t.closeListen(self.listener), "closeListen")
        check(self.t.finalize(self.ctx), "finalize")


def wait_word(array: np.ndarray, index: int, value: int, timeout: float = 30.0, progress=None) -> None:
    """Polls a host signal word; `progress` (a Rank, or a list of them) is driven meanwhile, as
    NCCL's proxy thread would. The sender must be among them: a request that test() said done
    may not have delivered yet (the unkind mode's early completion), and only progress delivers."""
    deadline = time.monotonic() + timeout
    ranks = progress if isinstance(progress, (list, tuple)) else [progress] if progress is not None else []
    while int(array[index]) < value:
        for rank in ranks:
            rank.progress()
        if time.monotonic() > deadline:
            raise TimeoutError(f"signal word {index} stayed at {int(array[index])}, expected {value}")
        time.sleep(0.0005)


class Proxy:
    """What the plugin sees of one rank's NCCL GIN proxy thread: requests are posted and not waited
    for one by one; each poll tests every request not yet done, oldest first, and never tests a
    request again once it said done (NCCL keeps the pointer; the plugin has freed it), then calls
    rmaProgress."""

    def __init__(self, rank: Rank):
        self.rank = rank
        self.pending = []  # [request, done] in posting order
        self._done = c_int()

    def post(self, request) -> list:
        entry = [request, False]
        self.pending.append(entry)
        return entry

    def poll(self) -> None:
        r = self.rank
        for entry in self.pending:
            if not entry[1]:
                self._done.value = 0
                check(r.t.test(r.comm, entry[0], ctypes.byref(self._done)), "test")
                entry[1] = bool(self._done.value)
        while self.pending and self.pending[0][1]:
            self.pending.pop(0)
        r.progress()


class CreditRing:
    """One rank's side of the loop that lost its 172nd put on GPUs, posted the way NCCL's proxy
    posts it. The rank streams `iterations` puts of up to PAYLOAD bytes to both ring neighbours
    (two directions, so that data and credits cross on every connection) into a receiver ring of
    `window` slots per sender: put k goes once the receiver returned credit k - window, and its
    source slot is rewritten only after the put that last read it completed (what NCCL's flush
    gives a kernel). A put is a put-with-signal, or (every third) a plain put and then a bare
    signal on the same context; the receiver checks each payload as soon as its data signal counts
    it and returns a bare signal as the credit. Each direction's puts use one context, its credits
    another.

    That receiver takes "the data signal reached k" for "put k landed", as jaxgin's exchange
    kernel does: right only if a put's signal settles the puts before it (strong signals, one
    context). `weak` sends the data signals weak, and `rotate` = m > 0 moves the data puts to the
    next context after every m puts (as an exchange lane's context changed between calls of m
    chunks when it was its CTA's): the unkind transport then shows the rule wrong.

    Regions: data_array(window) and signal_array(), registered in that order (the signals with
    NEVER_RESET, as NCCL registers its GIN signals). Signal words: [puts arrived in direction 0,
    1, credits returned for direction 0, 1]."""

    PAYLOAD = 8192
    STEPS = (1, -1)

    @staticmethod
    def data_array(window: int) -> np.ndarray:
        # [source slots of direction 0, of direction 1, inbox from direction 0's sender, from 1's]
        return np.zeros(4 * window * CreditRing.PAYLOAD, np.uint8)

    @staticmethod
    def signal_array() -> np.ndarray:
        return np.zeros(4, np.uint64)

    def __init__(self, rank: Rank, data, signals, data_h, signal_h, iterations: int, window: int, weak: bool = False,
                 rotate: int = 0):
        self.r, self.data, self.signals, self.data_h, self.signal_h = rank, data, signals, data_h, signal_h
        self.iterations, self.window, self.weak, self.rotate = iterations, window, weak, rotate
        self.proxy = Proxy(rank)
        self.sent, self.consumed = [0, 0], [0, 0]
        self.source_busy = [[None] * window for _ in self.STEPS]  # the request that last read each slot

    @classmethod
    def size_of(cls, k: int) -> int:  # assorted sizes, 1 byte to a full slot
        return cls.PAYLOAD if k % 4 else 1 + (k * 37) % cls.PAYLOAD

    @classmethod
    def pattern(cls, sender: int, d: int, k: int) -> np.ndarray:
        n = cls.size_of(k)
        return ((np.arange(n, dtype=np.uint32) * (2 * k + 1) + 131 * sender + 17 * d + k) % 251).astype(np.uint8)

    def _source(self, d: int, k: int) -> int:
        return (d * self.window + k % self.window) * self.PAYLOAD

    def _inbox(self, d: int, k: int) -> int:
        return ((2 + d) * self.window + k % self.window) * self.PAYLOAD

    def finished(self) -> bool:
        return min(self.sent + self.consumed) >= self.iterations

    def state(self) -> str:
        return (f"rank {self.r.rank}: sent {self.sent}, consumed {self.consumed}, signal words "
                f"{self.signals.tolist()}, requests in flight {len(self.proxy.pending)}")

    def step(self) -> None:
        r, i, n, contexts = self.r, self.r.rank, self.r.nranks, self.r.contexts
        self.proxy.poll()
        for d, step in enumerate(self.STEPS):
            to, frm = (i + step) % n, (i - step) % n
            data_context, credit_context = (i + d) % contexts, (i + d + 1) % contexts
            # receive the put the data signal counts next, then return its credit
            k = self.consumed[d] + 1
            if k <= self.iterations and int(self.signals[d]) >= k:
                if int(self.signals[d]) > self.iterations:
                    raise AssertionError(f"{self.state()}: more signals than puts")
                got = self.data[self._inbox(d, k):self._inbox(d, k) + self.size_of(k)]
                np.testing.assert_array_equal(got, self.pattern(frm, d, k),
                                              err_msg=f"rank {i}, direction {d}: put {k} from rank {frm}")
                self.proxy.post(r.put(None, 0, 0, None, 0, frm, signal=self.signal_h, signal_off=8 * (2 + d),
                                      op=SIGNAL_INC, context=credit_context))
                self.consumed[d] = k
            # send when the receiver's slot is free and so is the source slot
            k = self.sent[d] + 1
            if self.rotate:
                data_context = (i + d + (k - 1) // self.rotate) % contexts
            strong = not self.weak
            busy = self.source_busy[d][k % self.window]
            if k <= self.iterations and int(self.signals[2 + d]) >= k - self.window and (busy is None or busy[1]):
                at, size, inbox = self._source(d, k), self.size_of(k), self._inbox(d, k)
                self.data[at:at + size] = self.pattern(i, d, k)
                if k % 3:
                    request = r.put(self.data_h, at, size, self.data_h, inbox, to, signal=self.signal_h,
                                    signal_off=8 * d, value=1, context=data_context, strong=strong)
                    self.source_busy[d][k % self.window] = self.proxy.post(request)
                else:  # the data, then a signal on its own: one context keeps them in order
                    request = r.put(self.data_h, at, size, self.data_h, inbox, to, context=data_context)
                    self.source_busy[d][k % self.window] = self.proxy.post(request)
                    self.proxy.post(r.put(None, 0, 0, None, 0, to, signal=self.signal_h, signal_off=8 * d, value=1,
                                          context=data_context, strong=strong))
                self.sent[d] = k

    def drain(self, deadline: float, progress=None) -> None:
        """After finished(): completes this rank's last requests and waits for its last credits,
        driving `progress` (default: this rank) meanwhile: the credits' senders must be among them."""
        while self.proxy.pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.state()}: requests never completed")
            self.proxy.poll()
        for word in (2, 3):
            wait_word(self.signals, word, self.iterations, timeout=max(deadline - time.monotonic(), 1),
                      progress=progress or self.r)


def _exchange_handles(directory: Path, rank: int, nranks: int, handle: bytes) -> list[bytes]:
    (directory / f"handle.{rank}.tmp").write_bytes(handle)
    os.rename(directory / f"handle.{rank}.tmp", directory / f"handle.{rank}")
    deadline = time.monotonic() + 60
    while not all((directory / f"handle.{r}").exists() for r in range(nranks)):
        if time.monotonic() > deadline:
            raise TimeoutError("peers did not publish their handles")
        time.sleep(0.01)
    return [(directory / f"handle.{r}").read_bytes() for r in range(nranks)]


def _barrier(directory: Path, name: str, rank: int, nranks: int, timeout: float = 60.0, progress=None) -> None:
    """Waits for every rank to reach `name`, driving `progress` (a Rank) meanwhile: what it has
    queued may still have to deliver for its peers to get there."""
    (directory / f"{name}.{rank}").write_text("")
    deadline = time.monotonic() + timeout
    while not all((directory / f"{name}.{r}").exists() for r in range(nranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers did not reach {name}")
        if progress is not None:
            progress.progress()
        time.sleep(0.01)


def _credit_ring(me: Rank, directory: Path, iterations: int, window: int) -> int:
    """Scenario credit_ring: this process's rank of CreditRing, with its own proxy thread (this
    one) as on a GPU host; prints "credit ring ok" when every word ends at exactly its count."""
    data, signals = CreditRing.data_array(window), CreditRing.signal_array()
    data_h, signal_h = me.register(data), me.register(signals, NEVER_RESET)
    ring = CreditRing(me, data, signals, data_h, signal_h, iterations, window)
    deadline = time.monotonic() + 120
    while not ring.finished():
        if time.monotonic() > deadline:
            print(f"stalled: {ring.state()}", flush=True)
            return 1
        ring.step()
    ring.drain(deadline)
    _barrier(directory, "drained", me.rank, me.nranks, progress=me)  # peers' signals to us are all in by now
    time.sleep(0.05)  # a stray extra signal would land by now
    words = signals.tolist()
    error = me.has_error()
    _barrier(directory, "checked", me.rank, me.nranks, progress=me)
    me.close()
    ok = words == [iterations] * 4 and not error
    print(f"credit ring {'ok' if ok else 'wrong'}: signal words {words}, error {error}", flush=True)
    return 0 if ok else 1


def _error_reported(me: Rank, seconds: float) -> bool:
    """Whether the transport reports an error (queryLastError) within `seconds`."""
    deadline = time.monotonic() + seconds
    while not me.has_error():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _first_error_past_a_lost_peer(me: Rank, data_h, signal_h, lost: int) -> int:
    """Posts a put to the `lost` rank the way NCCL's proxy does and returns the first error code
    that posting or testing it gave (0: it completed without one)."""
    done, deadline = c_int(0), time.monotonic() + 30
    try:
        request = me.put(data_h, 0, 64, data_h, 0, lost, signal=signal_h, signal_off=8 * me.rank)
        while request and not done.value:  # a null request is done
            if time.monotonic() > deadline:
                raise TimeoutError("a put to a lost peer neither completed nor failed")
            check(me.t.test(me.comm, request, ctypes.byref(done)), "test")
            me.progress()
    except TransportError as e:
        return e.code
    return 0


def _drain_puts_past_a_lost_peer(me: Rank, data_h, signal_h, lost: int, other: int, count: int) -> float:
    """Posts `count` puts to the `lost` rank and as many to `other`, the way NCCL's proxy posts
    and tests them (more than NCCL's GPU-to-proxy queue of 32 x maxRecvs = 256 holds), until every
    one completed; returns the seconds that took. Each put +1s signal word `me.rank` there."""
    start = time.monotonic()
    proxy = Proxy(me)
    for _ in range(count):
        proxy.post(me.put(data_h, 0, 64, data_h, 0, lost, signal=signal_h, signal_off=8 * me.rank))
        proxy.post(me.put(data_h, 0, 64, data_h, 64, other, signal=signal_h, signal_off=8 * me.rank))
        proxy.poll()
    while proxy.pending:
        if time.monotonic() > start + 60:
            raise TimeoutError("puts past a lost peer never completed")
        proxy.poll()
    return time.monotonic() - start


def main(argv: list[str]) -> int:
    library, directory, rank, nranks, scenario = argv[1], Path(argv[2]), int(argv[3]), int(argv[4]), argv[5]
    table = load(library)
    me = Rank(table, contexts=3 if scenario.startswith("credit_ring") else 2)
    me.connect(_exchange_handles(directory, rank, nranks, me.handle.raw), rank)
    if scenario.startswith("credit_ring"):  # credit_ring-ITERATIONS-WINDOW
        _, iterations, window = scenario.split("-")
        return _credit_ring(me, directory, int(iterations), int(window))
    data = np.zeros(1 << 16, np.uint8)
    signals = np.zeros(nranks, np.uint64)
    data_h, signal_h = me.register(data), me.register(signals, NEVER_RESET)
    (directory / f"ready.{rank}").write_text("")
    if scenario in ("die", "die-fail") and rank == nranks - 1:
        os._exit(3)  # no goodbye: the survivors must notice
    if scenario == "freeze" and rank == nranks - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # reads nothing more, and its connections stay open
        time.sleep(3600)
    if scenario in ("die", "die-fail") and not _error_reported(me, 30):
        print("no error reported after a peer died", flush=True)
        return 1
    if scenario == "die-fail":  # JAXGIN_TRANSPORT_PEER_LOSS=fail
        code = _first_error_past_a_lost_peer(me, data_h, signal_h, nranks - 1)
        print(f"the put to the dead rank failed with code {code}{' (rmaRemoteError)' if code == 6 else ''}",
              flush=True)
        survivor, other = (rank - 1) % (nranks - 1), (rank + 1) % (nranks - 1)
        me.wait(me.put(data_h, 0, 64, data_h, 64, other, signal=signal_h, signal_off=8 * rank))
        wait_word(signals, survivor, 1, progress=me)
        print("the survivor's put arrived", flush=True)
        _barrier(directory, "reported", rank, nranks - 1, progress=me)
        return 0
    if scenario == "die":
        # Ranks 0..nranks-2 survive; each puts to the dead rank and to another survivor.
        seconds = _drain_puts_past_a_lost_peer(me, data_h, signal_h, nranks - 1, (rank + 1) % (nranks - 1), 300)
        survivor = (rank - 1) % (nranks - 1)
        wait_word(signals, survivor, 300, progress=me)
        from jaxgin import transport

        print(f"puts to the dead rank and a survivor completed in {seconds:.3f} s, error reported {me.has_error()}, "
              f"the survivor's {int(signals[survivor])} arrived; operations dropped: "
              f"{transport.counters(library)['ops_dropped']}", flush=True)
        print(f"lost peers: {transport.lost_peers(library)}", flush=True)
        # A survivor that exits also ends its connections without a goodbye; one that read its
        # lost peers first must not see the other survivors leave.
        _barrier(directory, "reported", rank, nranks - 1, progress=me)
        return 0
    if scenario == "freeze":
        while not (directory / f"ready.{nranks - 1}").exists():
            time.sleep(0.01)
        time.sleep(0.3)  # the last rank has stopped itself by now
        start = time.monotonic()
        proxy = Proxy(me)
        for _ in range(400):  # 25 MiB: far more than the sockets between them buffer
            proxy.post(me.put(data_h, 0, len(data), data_h, 0, nranks - 1, signal=signal_h, signal_off=8 * rank))
            proxy.poll()
        while proxy.pending:
            proxy.poll()
        print(f"puts to the stopped rank completed in {time.monotonic() - start:.1f} s, error reported "
              f"{me.has_error()}", flush=True)
        return 0
    # scenario "ring": one round, then a clean close
    right = (rank + 1) % nranks
    data[:1024] = rank + 1
    me.wait(me.put(data_h, 0, 1024, data_h, 1024, right, signal=signal_h, signal_off=8 * rank, value=5))
    left = (rank - 1) % nranks
    wait_word(signals, left, 5, progress=me)
    ok = bool((data[1024:2048] == left + 1).all())
    _barrier(directory, "done", rank, nranks, progress=me)
    me.close()
    print("ring ok" if ok else "ring data wrong", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
