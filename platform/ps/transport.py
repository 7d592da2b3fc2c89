"""The parameter servers' transport: calls of served objects' methods over ZeroMQ (pyzmq), replacing
``torch.distributed.rpc`` (TensorPipe, in maintenance mode); bench/ps_transport.py measured the choice.

A `Server` (a ROUTER socket on ``tcp://HOST:PORT``, port chosen by the OS) serves objects by name: every
public method is callable, run on a pool of threads so blocking calls (clock waits) do not stop pulls. A
`Client` (one DEALER socket per server, one I/O thread) sends calls and returns `Reply` futures; `Handle`
gives the ``handle.rpc_async().method(*args)`` / ``handle.rpc_sync(timeout).method(*args)`` form.

Wire: a message is ``[kind, request id, pickle header, *buffers]``. Tensors are pickled as numpy arrays with
protocol 5, so their memory goes out of band as zero-copy frames (no Python-level copy: the receiver's
tensors are views of the received frames, moved once to a 64-byte boundary when libzmq put one elsewhere,
`_aligned`). A connection says hello with `PROTOCOL`, the job's secret (`runtime.ps_session`), its host and
name, and goodbye on close; the size cap, heartbeats and lost peers: platform/README.md, "Parameter-server
transport".
"""

from __future__ import annotations

import concurrent.futures
import hmac
import io
import itertools
import logging
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zmq

log = logging.getLogger("mariana")

PROTOCOL = 2  # bump on any change of the message layout: peers of two versions refuse each other
MAX_MSG_BYTES = int(float(os.environ.get("MARIANA_PS_MAX_MSG_MB", "2048")) * 2**20)
_INPROC = itertools.count()  # in-process socket names; an object's id() is reused once it is freed
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool}  # fmt: skip


class TransportError(RuntimeError):
    """A refused connection, a peer lost, or an error raised by the called method (its type and text)."""


def peer_timeout_s() -> float:
    return float(os.environ.get("MARIANA_PS_PEER_TIMEOUT_S", "30"))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.dtype in _NUMPY_DTYPES and obj.device.type == "cpu":
            return torch.from_numpy, (obj.detach().contiguous().numpy(),)  # the array goes out of band
        return NotImplemented


def encode(obj) -> list:
    """``obj`` -> frames: the pickle, then every tensor's memory (not copied)."""
    bufs: list = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=bufs.append).dump(obj)
    return [f.getbuffer(), *(b.raw() for b in bufs)]


def decode(frames: list):
    """Frames (``zmq.Frame``) -> the object; its tensors are views of the frames' memory (`_aligned`)."""
    return pickle.loads(frames[0].buffer, buffers=[_aligned(f.buffer) for f in frames[1:]])


def _aligned(buf: memoryview):
    """``buf``, or a copy of it at a 64-byte boundary (as torch allocates) when it is not: libzmq hands
    out frames at any offset, and BLAS kernels round differently on unaligned inputs, which broke the
    bit-equality of a bulk-synchronous job with one process."""
    if np.frombuffer(buf, np.uint8).ctypes.data % 64 == 0:
        return buf
    out = np.empty(len(buf) + 64, np.uint8)
    off = -out.ctypes.data % 64
    out[off : off + len(buf)] = np.frombuffer(buf, np.uint8)
    return out[off : off + len(buf)]


def _socket(kind: int, connect: str = "", linger: int = 2000) -> zmq.Socket:
    """A ``kind`` socket, connected to ``connect`` if given; queued messages (replies) leave for ``linger`` ms."""
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
    s.setsockopt(zmq.LINGER, linger)
    if connect:
        s.connect(connect)
    return s


def _pusher(local: threading.local, inproc: str) -> zmq.Socket:
    """This thread's PUSH socket to ``inproc`` (a zmq socket is used by one thread only)."""
    if getattr(local, "push", None) is None:
        local.push = _socket(zmq.PUSH, inproc)
    return local.push


class Server:
    """Serves ``objects`` (name -> object) to peers that know ``secret`` on ``tcp://host:*`` (``address``:
    ``host:port``); ``threads`` calls run at once; ``on_lost(host, name)`` is called for a peer silent for
    the peer timeout. `close` stops it."""

    def __init__(
        self, objects: dict, secret: bytes, host: str = "127.0.0.1", threads: int = 16, on_lost=None
    ):
        self.objects, self.secret, self.on_lost = objects, secret, on_lost
        self.sock = _socket(zmq.ROUTER)
        self.address = f"{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.inbox = f"inproc://ps-server-{next(_INPROC)}"
        self.replies = _socket(zmq.PULL)
        self.replies.bind(self.inbox)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ps-call")
        self.local, self.closed = threading.local(), threading.Event()
        self.peers: dict[bytes, list] = {}  # peer -> [when last heard, its host, its name]
        # what a step's time and bytes go to (the job's counters): bytes in/out, decode + encode seconds,
        # seconds in each served method
        self.stats: dict[str, float] = {"bytes_in": 0, "bytes_out": 0, "codec_s": 0.0}
        self.stats_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="ps-server", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        checked = time.monotonic()
        while True:
            events, now = dict(poller.poll(50)), time.monotonic()
            if self.on_lost and now - checked > 1:
                checked, limit = now, peer_timeout_s()
                for ident, (heard, host, name) in list(self.peers.items()):
                    if now - heard > limit:
                        del self.peers[ident]
                        self.on_lost(host, name)
            if self.replies in events:
                frames = self.replies.recv_multipart(copy=False)
                self.stats["bytes_out"] += sum(len(f) for f in frames)
                self.sock.send_multipart(frames, copy=False)
            if self.sock in events:
                frames = self.sock.recv_multipart(copy=False)
                self.stats["bytes_in"] += sum(len(f) for f in frames)
                self._on_message(frames)
            if not events and self.closed.is_set():  # nothing left to send: stop
                break
        self.sock.close()

    def _on_message(self, frames: list) -> None:
        ident, kind, rid = frames[0].bytes, frames[1].bytes, frames[2].bytes
        if ident in self.peers:
            self.peers[ident][0] = time.monotonic()
        if kind == b"P":  # heartbeat: answered here, never queued behind calls
            self.sock.send_multipart([ident, b"P", rid])
        elif kind == b"B":  # goodbye: a peer that closed is not lost
            self.peers.pop(ident, None)
        elif kind == b"H":
            version, secret, *who = pickle.loads(frames[3].bytes)
            why = None
            if version != PROTOCOL:
                why = f"protocol version {version}, this server speaks version {PROTOCOL}"
            elif not hmac.compare_digest(bytes(secret), self.secret):
                why = "wrong job secret"
            else:
                self.peers[ident] = [time.monotonic(), *(who or ("?", "a peer"))]
            if why:
                log.warning("transport %s: refused a connection (%s)", self.address, why)
            self.sock.send_multipart(
                [ident, b"R", rid, *encode(("err", f"refused: {why}") if why else ("ok", 0))]
            )
        elif ident not in self.peers:
            self.sock.send_multipart(
                [ident, b"R", rid, *encode(("err", "refused: no hello with the job's secret"))]
            )
        else:
            self.pool.submit(self._call, ident, rid, frames[3:])

    def _call(self, ident: bytes, rid: bytes, frames: list) -> None:
        t0 = time.perf_counter()
        method = "?"
        try:
            name, method, args = decode(frames)
            if method.startswith("_"):
                raise AttributeError(f"{method} is not served")
            t1 = time.perf_counter()
            out = ("ok", getattr(self.objects[name], method)(*args))
        except Exception as e:  # the caller gets it
            t1, out = time.perf_counter(), ("err", f"{type(e).__name__}: {e}")
        t2 = time.perf_counter()
        frames = [ident, b"R", rid, *encode(out)]
        t3 = time.perf_counter()
        with self.stats_lock:
            self.stats["codec_s"] += t1 - t0 + t3 - t2
            self.stats[f"{method}_s"] = self.stats.get(f"{method}_s", 0.0) + t2 - t1
        _pusher(self.local, self.inbox).send_multipart(frames, copy=False)

    def close(self) -> None:
        self.closed.set()
        self.thread.join()
        self.pool.shutdown(wait=False, cancel_futures=True)


class Reply(concurrent.futures.Future):
    """A call's answer: ``wait()`` gives the method's value, or raises `TransportError`."""

    timeout: float | None = None

    def wait(self):
        return self.result(self.timeout)

    def then(self, fn) -> Reply:
        """A `Reply` of ``fn(self)``, run once this one is done."""
        out = Reply()

        def done(f):
            try:
                out.set_result(fn(f))
            except Exception as e:  # the chained reply carries it
                out.set_exception(e)

        self.add_done_callback(done)
        return out


class Client:
    """Calls to the servers at ``addresses`` (``host:port`` each), proving the job's ``secret``; raises
    `TransportError` if a server refuses or does not answer the hello in ``timeout_s``. ``who``: (this host,
    this peer's name); ``on_lost(host, name)``: called first for a lost server (``hosts``: theirs)."""

    def __init__(self, addresses: list[str], secret: bytes, timeout_s: float = 300.0, who=("?", "a client"),
                 hosts=None, on_lost=None):  # fmt: skip
        self.addresses, self.timeout, self.on_lost = addresses, timeout_s, on_lost
        self.hosts = hosts or ["?"] * len(addresses)
        self.socks = [_socket(zmq.DEALER, f"tcp://{a}", linger=0) for a in addresses]
        self.outbox, self.local = f"inproc://ps-client-{next(_INPROC)}", threading.local()
        self.out = _socket(zmq.PULL)
        self.out.bind(self.outbox)
        self.pending: dict[bytes, tuple[int, Reply]] = {}
        self.lock, self.ids, self.closed = threading.Lock(), itertools.count(), threading.Event()
        self.dead: list[str | None] = [None] * len(addresses)
        self.thread = threading.Thread(target=self._loop, name="ps-client", daemon=True)
        self.thread.start()
        hello = [pickle.dumps((PROTOCOL, secret, *who))]
        for r in [self.send(s, b"H", hello) for s in range(len(addresses))]:
            r.timeout = timeout_s
            r.wait()

    def send(self, server: int, kind: bytes, frames: list) -> Reply:
        reply, rid = Reply(), next(self.ids).to_bytes(8, "little")
        with self.lock:
            if self.dead[server]:
                reply.set_exception(TransportError(self.dead[server]))
                return reply
            self.pending[rid] = (server, reply)
        head = [server.to_bytes(4, "little"), kind, rid]
        _pusher(self.local, self.outbox).send_multipart([*head, *frames], copy=False)
        return reply

    def call(self, server: int, name: str, method: str, args: tuple, timeout: float | None = None) -> Reply:
        """``objects[name].method(*args)`` on server ``server``; ``timeout`` 0: none, None: the client's."""
        reply = self.send(server, b"C", encode((name, method, args)))
        reply.timeout = self.timeout if timeout is None else (timeout or None)
        return reply

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in [self.out, *self.socks]:
            poller.register(s, zmq.POLLIN)
        limit = peer_timeout_s()
        heard = [time.monotonic()] * len(self.socks)
        pinged = list(heard)
        while not self.closed.is_set():
            events = dict(poller.poll(100))
            now = time.monotonic()
            if self.out in events:
                frames = self.out.recv_multipart(copy=False)
                self.socks[int.from_bytes(frames[0].bytes, "little")].send_multipart(frames[1:], copy=False)
            for i, s in enumerate(self.socks):
                if s in events:
                    heard[i] = now
                    self._on_reply(s.recv_multipart(copy=False))
                elif now - heard[i] > limit and not self.dead[i]:
                    self._lost(i, f"server {self.addresses[i]} sent nothing for {limit:.0f} s: lost")
                elif now - pinged[i] > limit / 5:
                    s.send_multipart([b"P", b""])
                    pinged[i] = now
        for s in self.socks:
            s.send_multipart([b"B", b""])  # goodbye (sent within the linger): not taken for a lost peer
            s.close(linger=500)
        self.out.close()

    def _on_reply(self, frames: list) -> None:
        if frames[0].bytes != b"R":
            return  # a heartbeat
        with self.lock:
            _, reply = self.pending.pop(frames[1].bytes, (None, None))
        if reply is None:
            return
        status, value = decode(frames[2:])
        if status == "ok":
            reply.set_result(value)
        else:
            reply.set_exception(TransportError(value))

    def _lost(self, server: int, why: str) -> None:
        if self.on_lost:
            self.on_lost(self.hosts[server], f"server {server} at {self.addresses[server]}")
        log.error("transport: %s", why)
        with self.lock:
            self.dead[server] = why
            lost = [rid for rid, (s, _) in self.pending.items() if s == server]
            replies = [self.pending.pop(rid)[1] for rid in lost]
        for r in replies:
            r.set_exception(TransportError(why))

    def close(self) -> None:
        self.closed.set()
        self.thread.join()


class Handle:
    """The object served as ``name`` by server ``server`` of ``client``: ``rpc_async().m(*args)`` -> a
    `Reply`; ``rpc_sync(timeout).m(*args)`` -> its value (``timeout`` 0: wait as long as it takes)."""

    def __init__(self, client: Client, server: int, name: str = "ps"):
        self.client, self.server, self.name = client, server, name

    def rpc_async(self, timeout: float | None = None) -> _Proxy:
        return _Proxy(self, timeout, wait=False)

    def rpc_sync(self, timeout: float | None = None) -> _Proxy:
        return _Proxy(self, timeout, wait=True)


class _Proxy:
    def __init__(self, handle: Handle, timeout: float | None, wait: bool):
        self.handle, self.timeout, self.wait = handle, timeout, wait

    def __getattr__(self, method: str):
        h = self.handle

        def call(*args):
            reply = h.client.call(h.server, h.name, method, args, self.timeout)
            return reply.wait() if self.wait else reply

        return call
