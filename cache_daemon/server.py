"""The cache daemon: an asyncio server on a Unix socket that holds arenas and hands out their fds.

It never imports torch or touches CUDA: a loader child does the heavy work and sends the arenas here
(``loader.py``). Each client connection says Hello, then asks Query/Fetch/Status/Ping/Evict; one
dispatch answers each and refuses anything else. A connection that stays silent longer than
``client_timeout`` before it has fetched is closed; one that holds a mapping may stay idle forever.
A frame must arrive whole within ``frame_timeout`` of its first byte, attached or not, and the frames
being received by all connections together may reserve at most ``max_buffered`` bytes: a frame past
either limit closes its connection with an error. A bad frame ends only its own connection.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import structlog

from . import framing, runfiles
from .errors import FingerprintMismatch, NotResident, ProtocolError
from .peers import peer_allowed, peer_credentials
from .loading import run_loader
from .protocol import (PROTOCOL_VERSION, Error, Evict, Evicted, Fetch, FetchReply, Hello, LoadState, Ping, Pong,
                       Query, QueryReply, Status, StatusReply, Welcome)
from .residents import Registry, Resident
from .settings import DaemonSettings
from failover_common.progress import LoadBar
from failover_common.tasks import Tasks

log = structlog.get_logger(__name__)
STOP_TIMEOUT_S = 5.0  # per shutdown step
RESYNCABLE = ("unknown_type", "malformed")  # the whole frame was read: the stream is still in step
# accept() failing for want of fds or kernel memory: the listener is fine, we are out of room. Wait
# for connections to close (they free fds) rather than die: without a backoff the listener, still
# readable, would spin the loop; without the catch the accept task ended silently and the daemon
# never answered again while it looked alive.
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = (0.01, 0.5)  # first retry, cap (doubling in between)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    uid: int
    attached: list[Resident] = field(default_factory=list)


class _Starvation:
    """Bookkeeping of one burst of failed accepts: logged once when it starts and once when it ends."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.count = 0
        self.delay = ACCEPT_BACKOFF_S[0]

    def failed(self, e: OSError) -> float:
        """Note a failed accept; returns how long to wait before the next one."""
        if isinstance(e, ConnectionAbortedError):
            return 0.0
        if self.since is None:
            self.since, self.count, self.delay = time.monotonic(), 0, ACCEPT_BACKOFF_S[0]
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.error("accept_starved", errno=errno.errorcode.get(e.errno, e.errno), error=e.strerror,
                      open_fds=_open_fds(), fd_limit=soft,
                      hint="new clients wait in the backlog until connections close; raise the fd "
                           "limit (ulimit -n / LimitNOFILE) if this recurs")
        self.count += 1
        delay, self.delay = self.delay, min(self.delay * 2, ACCEPT_BACKOFF_S[1])
        return delay

    def recovered(self) -> None:
        if self.since is not None:
            log.warning("accept_recovered", failed_accepts=self.count,
                        starved_ms=round((time.monotonic() - self.since) * 1e3, 1))
            self.since = None


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # listing needs an fd too, which is what we are short of
        return None


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.s = settings
        self.registry = Registry()
        self.conns: set[_Conn] = set()
        self.budget = framing.FrameBudget(settings.max_buffered)  # frames being received, all clients
        self.loading = True
        self.load: LoadState | None = None  # the loader's last progress report
        self.exit_code = 0
        self.failure: str | None = None  # why the load failed, for the CLI's one-line error
        self._tasks = Tasks()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT or a failed load; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, f"signal {signal.Signals(sig).name}")
        runfiles.prepare_run_dir(self.s.run_dir)
        runfiles.claim(self.s.socket_path, self.s.ready_path, force=self.s.force)
        self._listener, self._inode = runfiles.bind(self.s.socket_path)
        log.info("daemon_listening", socket=str(self.s.socket_path), pid=os.getpid(), model=str(self.s.model),
                 tp=self.s.tp, device=self.s.device, transform=self.s.transform)
        accept = asyncio.create_task(self._accept_loop(), name="accept")
        accept.add_done_callback(self._accept_ended)
        load = asyncio.create_task(self._load(), name="load")
        await self._stop.wait()
        await self._shutdown(accept, load)
        return self.exit_code

    def stop(self, reason: str, exit_code: int = 0) -> None:
        log.info("daemon_stopping", reason=reason)
        self.exit_code = self.exit_code or exit_code
        self._stop.set()

    async def _shutdown(self, accept: asyncio.Task, load: asyncio.Task) -> None:
        # 1. No new clients: stop accepting and remove the socket and ready file first, so a client
        #    starting now sees "no daemon" rather than a half-dead one.
        accept.cancel()
        self._listener.close()
        runfiles.remove_ours(self.s.socket_path, self._inode, self.s.ready_path)
        # 2. Stop the loader if it is still at work (its finally terminates, then kills, the child).
        load.cancel()
        await asyncio.wait([accept, load], timeout=STOP_TIMEOUT_S + 2)
        # 3. Close every client connection; their mappings stay valid without us.
        await self._tasks.stop(timeout=STOP_TIMEOUT_S)
        # 4. Drop our fds: memory is freed once no client maps it any more.
        self.registry.close()
        log.info("daemon_stopped", exit_code=self.exit_code)

    # ---- the loader child --------------------------------------------------------------------

    async def _load(self) -> None:
        t0 = time.monotonic()
        bar = LoadBar("loading weights", sys.stderr, self.s.progress, model=str(self.s.model))

        def progress(done: int, total: int) -> None:
            self.load = LoadState(done, total, round(time.monotonic() - t0, 3))
            bar.update(done, total, self.load.seconds)

        try:
            failure = await run_loader(self.s, self.registry, progress)
        except BaseException:  # cancelled (shutdown): the bar's line ends, the cancel goes on
            bar.abandon()
            raise
        if failure is None and self.load is not None:
            bar.finish(self.load.total, time.monotonic() - t0)
        else:
            bar.abandon()  # the error goes on a line of its own
        if failure is not None:
            log.error("load_failed", message=failure)
            self.failure = failure
            self.stop("load failed", exit_code=1)
            return
        self.loading = False
        runfiles.write_ready(self.s.ready_path, socket_path=self.s.socket_path,
                             fingerprints=self.registry.fingerprints())
        log.info("daemon_ready", ranks=len(self.registry), bytes=sum(m.nbytes for m in self.registry.status()))

    # ---- clients -----------------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        starved = _Starvation()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as e:
                if e.errno not in ACCEPT_RESOURCE_ERRNOS and not isinstance(e, ConnectionAbortedError):
                    raise
                await asyncio.sleep(starved.failed(e))  # a peer that gave up (ECONNABORTED) costs 0
                continue
            starved.recovered()
            sock.setblocking(False)
            self._tasks.spawn(self._serve(sock), "client")

    def _accept_ended(self, task: asyncio.Task) -> None:
        """The accept loop never ends but by cancel: anything else would leave a daemon that looks
        alive and answers nobody, so it stops the daemon (exit 1) for its supervisor to restart."""
        if task.cancelled() or self._stop.is_set():
            return
        exc = task.exception()
        log.error("accept_loop_failed", error=repr(exc), hint="the daemon stops; its supervisor restarts it")
        self.stop("accept loop failed", exit_code=1)

    async def _serve(self, sock: socket.socket) -> None:
        pid, uid, _ = peer_credentials(sock)
        conn = _Conn(sock, pid, uid)
        self.conns.add(conn)
        log.debug("client_connected", peer_pid=pid, peer_uid=uid)
        try:
            if not peer_allowed(uid, daemon_uid=os.getuid(), allow_uids=self.s.allow_uids):
                log.warning("client_refused", peer_pid=pid, peer_uid=uid)
                return await self._reply(conn, Error("forbidden", f"uid {uid} may not use this daemon "
                                                     "(run as the daemon's user or add --allow-uid)"))
            if await self._handshake(conn):
                while await self._serve_one(conn):
                    pass
        except asyncio.TimeoutError:
            log.info("client_timed_out", peer_pid=pid, timeout_s=self.s.client_timeout)
            await self._reply(conn, Error("timeout", f"no request within {self.s.client_timeout} s"))
        except ProtocolError as e:
            if e.code != "closed":
                log.info("client_protocol_error", peer_pid=pid, code=e.code, error=str(e))
                await self._reply(conn, Error(e.code, str(e)))
        except OSError as e:  # reset by peer and the like: the client's problem alone
            log.info("client_io_error", peer_pid=pid, error=str(e))
        finally:
            for r in conn.attached:
                r.attached -= 1
            self.conns.discard(conn)
            sock.close()
            log.debug("client_closed", peer_pid=pid)

    async def _handshake(self, conn: _Conn) -> bool:
        msg = await self._read(conn)
        if not isinstance(msg, Hello):
            await self._reply(conn, Error("unexpected", f"first message must be hello, not {type(msg).__name__}"))
            return False
        if msg.version != PROTOCOL_VERSION:
            await self._reply(conn, Error("bad_version", f"daemon speaks protocol {PROTOCOL_VERSION}, client "
                                          f"{msg.version}: use a client from the same failover release"))
            return False
        await self._reply(conn, Welcome(PROTOCOL_VERSION, os.getpid()))
        return True

    async def _serve_one(self, conn: _Conn) -> bool:
        try:
            msg = await self._read(conn)
        except ProtocolError as e:
            if e.code not in RESYNCABLE:
                raise
            log.info("client_bad_message", peer_pid=conn.pid, code=e.code, error=str(e))
            await self._reply(conn, Error(e.code, str(e)))
            return True
        reply, fds = self._dispatch(conn, msg)
        fds = [os.dup(fd) for fd in fds]  # our own copies: an Evict may close the registry's meanwhile
        try:
            await self._reply(conn, reply, fds)
        finally:
            framing.close_fds(fds)
        return True

    async def _read(self, conn: _Conn):
        # Idle time is bounded only before attach (a mapping holder may stay quiet forever); a frame
        # that has started must finish within frame_timeout either way, so no client can park a
        # partly sent frame (and the memory reserved for it) here.
        await asyncio.wait_for(framing.wait_readable(conn.sock), None if conn.attached else self.s.client_timeout)
        try:
            msg, _ = await asyncio.wait_for(framing.async_recv_frame(conn.sock, budget=self.budget),
                                            self.s.frame_timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"frame not complete within {self.s.frame_timeout} s of its first byte",
                                "timeout") from None
        return msg

    async def _reply(self, conn: _Conn, msg, fds=()) -> None:
        try:
            await asyncio.wait_for(framing.async_send_frame(conn.sock, msg, fds), self.s.client_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            log.info("client_reply_failed", peer_pid=conn.pid, error=str(e) or type(e).__name__)

    def _dispatch(self, conn: _Conn, msg):
        """The one place requests are answered; anything not listed is refused."""
        try:
            if isinstance(msg, Ping):
                return Pong(msg.nonce), ()
            if isinstance(msg, Status):
                return self._status(), ()
            if isinstance(msg, Query):
                r = self.registry.find(msg.config)
                return QueryReply(r.manifest.nbytes, r.attached), ()
            if isinstance(msg, Fetch):
                r = self.registry.find(msg.config)
                r.attached += 1
                conn.attached.append(r)
                log.info("client_attached", peer_pid=conn.pid, key=r.config.key, rank=r.config.tp_rank)
                return FetchReply(r.manifest, len(r.fds)), r.fds
            if isinstance(msg, Evict):
                return self._evict(msg), ()
        except NotResident as e:
            more = " (still loading: wait for the ready file)" if self.loading else ""
            return Error("not_resident", str(e) + more), ()
        except FingerprintMismatch as e:
            return Error("mismatch", str(e).split("\n")[0], e.diff), ()
        return Error("unexpected", f"{type(msg).__name__} is not a request a client may send"), ()

    def _evict(self, msg: Evict) -> Evicted | Error:
        attached = self.registry.find(msg.config).attached
        if attached and not msg.force:
            log.warning("evict_refused", key=msg.config.key, attached=attached)
            return Error("in_use", f"{attached} engine(s) map this model: a running node depends on it to "
                         "relaunch them; evict with force to drop it anyway (the engines keep their "
                         "mapping, but none can attach until the daemon loads it again)")
        nbytes = self.registry.evict(msg.config)
        log.info("evicted", key=msg.config.key, bytes=nbytes)
        if len(self.registry) == 0:
            runfiles.remove(self.s.ready_path)
        elif not self.loading:
            runfiles.write_ready(self.s.ready_path, socket_path=self.s.socket_path,
                                 fingerprints=self.registry.fingerprints())
        return Evicted(nbytes)

    def _status(self) -> StatusReply:
        return StatusReply(pid=os.getpid(), version=PROTOCOL_VERSION, loading=self.loading,
                           models=self.registry.status(), clients=len(self.conns),
                           attached=sum(1 for c in self.conns if c.attached), buffered=self.budget.used,
                           load=self.load)
