"""One client connection's protocol, without I/O: the state machine ``Connection`` drives.

A ``Link`` is told what happened (a message's frames arrived, the user took batches, time went
by) and the time, through its clock; what it does in answer it returns as actions, in order, to
whoever drives it (``take_actions``, as h2's ``data_to_send``): ``Connect`` a transport,
``Disconnect`` it, ``Transmit`` a message's frames, ``HandshakeDone`` (whatever watched the
transport's handshakes may stop). It asks its driver only what it cannot know itself: whether an
offered Unix socket is reachable from here, the shared-memory slabs there, and whether the
transport's connections are being refused. It holds no socket, no thread and no lock, and never
sleeps or waits: ``fuelline.client.connection.Connection`` drives it over a ZeroMQ socket, and a
simulation (``benchmarks.simulation``) drives thousands of them on a simulated network and clock.
A driver carries out the actions of one call before it makes the next.

The link tracks the position after the last batch it received. Batches and ends of epoch must
come in order: one ahead of the expected position means messages were lost in transit (a TCP
reset that libzmq reconnected under the same routing id drops what was queued on the old
connection), and so does a server heartbeat that counts more messages of the stream than
arrived; the link then asks again from its position. One behind it is a server bug, reported.
After a silence of three server heartbeat intervals or a server restart it reconnects at once
(its Hello waits in the new socket until a server answers); after a ``Bye``, or a server that is
full, after a jittered backoff. Either way it asks for exactly its position, so nothing is lost
or repeated. It gives up with ``ServerUnavailable`` after ``timeout`` seconds without hearing from
the server; until its first Welcome, after ``connect_timeout`` seconds of refused connections.
The position means the same batch only under the same sequence fingerprint
(``Welcome.fingerprint``): the link holds to the first one it hears (or the one ``hold_to`` gives
it), and fails with ``FingerprintMismatch`` on a Welcome that differs, before any batch of that
server is handed over.

Two counters tell messages apart. The *seek* counter is the user's: it changes on ``seek`` and
tags the items handed over (``Item.seek``). The *generation* (``_gen``; on the wire, the field
``stream`` of Hello, Welcome, Batch, EndOfEpoch and Heartbeat, named so for compatibility) changes
on every Hello: batches of a session a later Hello replaced carry an older one and are dropped.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from fuelline.client.slabs import SlabUnavailable
from fuelline.protocol import (
    DEFAULT_LIMITS,
    ArrayMeta,
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    ErrorCode,
    FingerprintMismatch,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    ServerUnavailable,
    Welcome,
    decode,
    encode,
)
from fuelline.protocol.placement import Placement

__all__ = ["Action", "Connect", "Disconnect", "HandshakeDone", "Item", "Link", "Transmit", "backoff_delay"]

log = logging.getLogger("fuelline.client")

MAX_LOSSES_IN_A_ROW = 3  # asking again from one position more often than this is a failure


def backoff_delay(backoff: float, rng: random.Random) -> float:
    """The wait before a reconnect: between half of ``backoff`` and all of it, at random, so
    that clients a server restart dropped together do not all come back in the same instant."""
    return backoff / 2 + rng.uniform(0.0, backoff / 2)


@dataclass(frozen=True, slots=True)
class Connect:
    """Open a transport to ``transport`` (messages sent before it connects wait for it)."""

    transport: str


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close the transport; what it had not sent is dropped."""


@dataclass(frozen=True, slots=True)
class Transmit:
    """Send one message's frames on the open transport (``kind``: the message's type)."""

    frames: list[Any]
    kind: str


@dataclass(frozen=True, slots=True)
class HandshakeDone:
    """A Welcome came: whatever watched the transport's handshakes may stop."""


Action = Connect | Disconnect | Transmit | HandshakeDone


@dataclass(frozen=True)
class Item:
    """A batch or an end of epoch, tagged with the seek counter of the position it belongs to."""

    seek: int
    kind: str  # "batch" or "end"
    epoch: int = 0
    seq: int = 0
    arrays: dict | None = None


class Link:
    """One server connection's protocol state.

    Args:
        endpoint: ``tcp://host:port``.
        hello: the Hello template (identity, rank, split, sources...); position and credit are
            filled in per (re)connect.
        hwm: batches the client may hold (received and not yet taken, plus in flight).
        heartbeat: the client's heartbeat interval.
        timeout: seconds without hearing the server before ServerUnavailable.
        connect_timeout: seconds of refused connections before the first Welcome after which
            ServerUnavailable is raised; once welcomed, a server that goes away gets ``timeout``.
        local: move to the server's Unix socket when its Welcome offers one this client can
            prove it shares (``_shares_host``). Reconnects start at ``endpoint`` again (the server
            may have moved), and move again.
        shared_memory: on the Unix socket, ask for batches placed in shared memory.
        clock: the time, in seconds (``time.monotonic``; a simulation's own).
        rng: draws the backoff's jitter (seeded by the system unless given).
    """

    BACKOFF_MIN = 0.05
    BACKOFF_MAX = 2.0
    _error: BaseException | None  # the failure every later call raises

    def __init__(
        self,
        endpoint: str,
        hello: Hello,
        *,
        hwm: int,
        heartbeat: float,
        timeout: float,
        verify: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        local: bool = True,
        connect_timeout: float | None = None,
        shared_memory: bool = True,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.transport = endpoint  # where the transport goes now: the endpoint, or the server's ipc path
        self._clock = clock
        self._local = local
        self._shared_memory = shared_memory and local
        self._slabs: Any = None  # on the Unix socket with shared memory: its slabs (``ClientSlabs``)
        self.welcome: Welcome | None = None
        self.reconnects = 0
        self.resumes_after_loss = 0  # times messages lost in transit were asked for again
        self.data_losses: list[str] = []  # what the server left out (--on-bad-shard skip), in its words
        self.data_loss_epochs: list[int] = []  # the epoch of each (notices come in order with batches)
        self.fingerprint: dict[str, str] | None = None  # the sequence this link's positions belong to
        self._fingerprint_at = ""  # where it came from, as an error names it
        self._template = hello
        self._hwm = hwm
        self._heartbeat = heartbeat
        self._timeout = timeout
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._verify = verify
        self._limits = limits
        self._items: deque[Item] = deque()
        self._messages = 0  # received so far (a driver's pace may follow it)
        self._error: BaseException | None = None
        self._open_now = False  # a transport is open
        self._seek = 0  # the user's seek counter (changes on seek); tags the items handed over
        self._gen = 0  # the Hello counter on the wire (changes on every Hello); tags batches
        self._pos = (0, 0)  # the next (epoch, seq) expected from the server
        self._history: tuple = ()  # segments of _pos's epoch run at other world sizes (Hello.history)
        self._undelivered = 0  # batches received for the current stream, not yet taken
        self._pending_credit = 0  # batches taken, not yet returned to the server as credit
        # Credit a Hello over TCP held back until its Welcome says whether this client moves to
        # the server's Unix socket (see _hello).
        self._withheld = 0
        self._granted = 0  # credit sent since the last Hello, its own included (see Heartbeat.sent)
        self._credit_group = max(1, hwm // 4)
        self._connected = False
        self._awaiting_welcome = False
        self._received = 0  # batches and ends of epoch of this Hello's stream received (see Heartbeat.sent)
        self._losses: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (position, losses met there in a row)
        self._server_heartbeat = heartbeat
        self._bye_reason = ""
        self._bye_pending = False
        self._busy_since: float | None = None  # when a server that welcomed us first said it was full
        self._backoff = self.BACKOFF_MIN
        self._jitter = rng if rng is not None else random.Random()  # (every client its own draws)
        self.retry_at: float | None = None  # when the next reconnect is due, while the link waits for it
        self._actions: list[Action] = []  # what the driver is to do, in order (take_actions)
        self._last_heard = self._last_sent = self._hello_sent = self._started = clock()

    # -- what it asks the driver (what the link cannot know) ------------------------------------------
    def _shares_host(self, local: Any) -> bool:
        """Whether the Unix socket a Welcome offers (``Welcome.local``) is reachable from here."""
        return False

    def _map_slabs(self, folder: str) -> Any:
        """The shared-memory slabs in ``folder`` (``ClientSlabs``), for a link that moved there."""
        return None

    def _refused_for(self, now: float, limit: float) -> float:
        """Seconds since the link began while the transport's connections are refused (nothing
        listens there), else 0."""
        return 0.0

    @property
    def _refused(self) -> bool:
        """The transport's connections are being refused now."""
        return False

    def _detail(self, detail: str) -> str:
        """``detail``, and what the driver knows of why the server was never heard properly."""
        return detail

    # -- what it answers ------------------------------------------------------------------------------
    def take_actions(self) -> list[Action]:
        """What the link needs done since the last call, in order; the driver carries it out."""
        actions, self._actions = self._actions, []
        return actions

    # -- the user's side -----------------------------------------------------------------------
    def begin(self, seek: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        """Open the link at a position (``seek``: its seek counter): connect, and say Hello."""
        self._seek, self._pos, self._history = seek, (epoch, cursor), tuple(history)
        self._last_heard = self._started = self._clock()
        self._open()

    def seek(self, seek: int, epoch: int, cursor: int, history: tuple = ()) -> None:
        """Restart at a position, under a new seek counter; items of older ones are dropped."""
        self._seek, self._pos, self._undelivered = seek, (epoch, cursor), 0
        self._history = tuple(history)
        self._items.clear()
        if self._open_now:
            self._say_hello()

    def credit(self, seek: int, n: int = 1) -> None:
        """The user took n batches tagged ``seek``: room for n more."""
        if seek == self._seek:
            self._undelivered -= n
            self._pending_credit += n
            self._flush_credit(2 * self._credit_group)

    def hold_to(self, fingerprint: dict[str, str], where: str) -> None:
        """Accept from now on only servers of this sequence fingerprint (``where`` names its
        origin in errors, e.g. "in the saved position").

        Raises:
            FingerprintMismatch: the server already heard from has another one (nothing changes).
        """
        if self.welcome is not None and self.welcome.fingerprint != fingerprint:
            raise FingerprintMismatch(fingerprint, self.welcome.fingerprint, where, f"at {self.endpoint}")
        self.fingerprint, self._fingerprint_at = dict(fingerprint), where

    def say_bye(self, reason: str) -> None:
        """Tell the server this client leaves (its transport stays open for the driver to close)."""
        self._send(Bye(reason))

    # -- time and messages -----------------------------------------------------------------------
    def receive(self, frames: list[Any]) -> None:
        """A message's frames arrived from the server."""
        self._last_heard = self._clock()
        self._messages += 1
        try:
            msg = decode(frames, limits=self._limits, verify=self._verify, place=self._place)
        except SlabUnavailable as exc:
            # Not to be mapped from here after all: the rest of this connection goes through
            # the socket, from the batch that could not be read (a Hello that says so).
            log.warning("server %s: %s; reading through the socket instead", self.endpoint, exc)
            self._slabs = None
            self._say_hello()
            return
        except ProtocolVersionError as exc:
            self._fail(ProtocolVersionError(exc.got, exc.expected, peer=self.endpoint))
            return
        except ProtocolError as exc:
            self._fail(ProtocolError(f"from {self.endpoint}: {exc}"))
            return
        handler = self._HANDLERS.get(type(msg))
        if handler is not None:
            getattr(self, handler)(msg)

    def reconnect_due(self) -> bool:
        """Reopen the transport once a backoff is over; False while it lasts (``retry_at``)."""
        if self._open_now or self.retry_at is None:
            return True
        if self._clock() < self.retry_at:
            return False
        self.reconnects += 1
        self.retry_at = None
        self.transport = self.endpoint  # the server may have restarted elsewhere: ask TCP again
        self._slabs = None
        self._open()
        return True

    def tick(self) -> None:
        """Keep the link alive: give up after too long, reconnect after silence (or a Bye),
        send a heartbeat when this side has been quiet."""
        if self._error is not None or not self._open_now:
            return
        now = self._clock()
        if not self._given_up(now):
            self._heartbeat_or_retry(now)

    # -- the state machine ---------------------------------------------------------------------
    def _hello(self) -> Hello:
        t = self._template
        credit = max(0, self._hwm - self._undelivered)
        # A client that may move to the server's Unix socket asks for nothing over TCP: the
        # server would prepare up to hwm batches for a session the move then replaces (and send
        # them again from its memory, copied into shared memory). Its Welcome says whether to
        # move; if not, the credit follows it.
        self._withheld = credit if self._local and self.transport == self.endpoint else 0
        return Hello(
            client_id=t.client_id,
            rank=t.rank,
            world_size=t.world_size,
            split=t.split,
            sources=t.sources,
            stream=self._gen,
            epoch=self._pos[0],
            cursor=self._pos[1],
            history=self._history if self._history else (),
            credit=credit - self._withheld,
            heartbeat=self._heartbeat,
            shm=self._slabs is not None,
        )

    def _open(self) -> None:
        self._actions.append(Connect(self.transport))
        self._open_now = True
        self._connected = False
        self._say_hello()

    def _say_hello(self) -> None:
        # A new generation per Hello: batches of a session this Hello replaces are told apart.
        self._gen += 1
        self._pending_credit = 0  # the Hello's credit (hwm - undelivered) includes it
        hello = self._hello()
        self._granted = hello.credit
        self._send(hello)
        self._hello_sent = self._clock()
        self._received = 0
        self._awaiting_welcome = True

    def _close_transport(self) -> None:
        self._pending_credit = 0  # the next Hello's credit includes it
        if self._open_now:
            self._actions.append(Disconnect())
            self._open_now = False
        self._connected = False

    def _send(self, msg: Any) -> None:
        if not self._open_now:
            return
        self._actions.append(Transmit(encode(msg), msg.TYPE))
        self._last_sent = self._clock()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._close_transport()

    def _flush_credit(self, group: int) -> None:
        """Return credit once ``group`` batches are pending, or nothing is left to take. The keep-alive
        thread returns a quarter of hwm while the user trains, the user's thread twice that: a send
        wakes libzmq's I/O thread, which on a busy host can cost the sender its time slice. Sent even
        before a Welcome (the server reads it after the Hello); else the next Hello's includes it."""
        slabs = self._slabs
        if (self._pending_credit and (self._pending_credit >= group or not self._items)) or (
                slabs is not None and len(slabs.released) >= max(group, 2)):
            self._send(Credit(self._pending_credit, slabs.take_released() if slabs is not None else ()))
            self._granted += self._pending_credit
            self._pending_credit = 0

    def _given_up(self, now: float) -> bool:
        """Fail (and True) where connections were refused, or the server silent, for too long."""
        silent = now - self._last_heard
        # Refused connections fail after connect_timeout, but only before the first Welcome: a
        # server welcomed once may be restarting, and gets the whole timeout.
        refusal_limit = self._timeout if self.welcome is not None else self._connect_timeout
        if self._refused_for(now, refusal_limit) > refusal_limit and self.welcome is None:
            self._fail(ServerUnavailable(self.endpoint, now - self._started, self._detail("")))
            return True
        if silent > self._timeout:
            detail = f"it said: {self._bye_reason}" if self._bye_reason else ""
            self._fail(ServerUnavailable(self.endpoint, silent, self._detail(detail)))
            return True
        return False

    def _heartbeat_or_retry(self, now: float) -> None:
        """A heartbeat when this side has been quiet; after silence (or a Bye), drop the transport
        and try again after a backoff."""
        silence_limit = 3 * (self._server_heartbeat if self._connected else self._heartbeat)
        # No Welcome for as long counts as silence, whatever else the server says: a Hello lost
        # with a server killed after it was sent is never answered by the next one, which only
        # replies no-session to heartbeats.
        unwelcome = self._awaiting_welcome and now - self._hello_sent > silence_limit
        if self._bye_pending or unwelcome or now - max(self._last_heard, self._hello_sent) > silence_limit:
            if unwelcome and now - self._last_heard <= silence_limit:
                log.warning("server %s sent no Welcome in %.1fs; reconnecting", self.endpoint, now - self._hello_sent)
            elif not self._bye_pending:
                # (Refused connections were told once, as such: retrying them is no news.)
                log.log(logging.DEBUG if self._refused else logging.WARNING,
                        "server %s silent for %.1fs; reconnecting", self.endpoint, now - self._last_heard)
            bye, self._bye_pending = self._bye_pending, False
            self._close_transport()
            if bye:
                # A server that said bye, or is full, is asked again after a backoff: at once, it
                # would only say the same again.
                self.retry_at = now + backoff_delay(self._backoff, self._jitter)
                self._backoff = min(self._backoff * 2, self.BACKOFF_MAX)
            else:
                # After silence, at once, with a Hello that waits in the new socket until the
                # server answers: the silence itself (3 heartbeats) paces the attempts. A socket
                # closed for a backoff kept its link from a restarted server for up to the
                # longest backoff (2 s), whether the wait was jittered or not (simulation of
                # 1,000 ranks × 100 servers); jitter did not lower the restarted server's peak
                # of Hellos, which those waiting in open sockets make in any case.
                self.retry_at = now
        elif now - self._last_sent >= self._heartbeat:
            # With the credit granted so far: the server makes good what it never received.
            self._send(Heartbeat(stream=self._gen, sent=self._granted))

    # -- each message ------------------------------------------------------------------------------
    def _out_of_order(self, what: str, where: tuple[int, int]) -> None:
        """A batch or an end that is not the one expected next: ahead of it, what came between was
        lost in transit; behind it, the server repeats itself, which is a bug to report."""
        if where > self._pos:
            self._lost(f"{what} arrived, expected {self._pos[0]}:{self._pos[1]}")
        else:
            self._fail(ProtocolError(f"{self.endpoint} sent {what}, expected {self._pos[0]}:{self._pos[1]}"))

    def _lost(self, why: str) -> None:
        """Messages lost in transit: ask again from the next undelivered position, as after a
        silence. The server's memory tier still holds what it sent."""
        where, count = self._losses
        count = count + 1 if where == self._pos else 1
        self._losses = (self._pos, count)
        if count > MAX_LOSSES_IN_A_ROW:
            self._fail(ProtocolError(
                f"{self.endpoint} lost messages at {self._pos[0]}:{self._pos[1]} {count} times in a row ({why})"))
            return
        log.warning("server %s: messages lost in transit (%s); asking again from %d:%d",
                    self.endpoint, why, *self._pos)
        self.resumes_after_loss += 1
        self._say_hello()

    def _full(self, message: str) -> None:
        """A server that welcomed this link before is full now (its session was given up to a
        newcomer while this client held its batches, or it restarted with fewer places): a place
        may come free, so it is asked again with backoff, as after silence, for up to ``timeout``;
        a client never welcomed is told at once (``RemoteError`` busy)."""
        now = self._clock()
        if self._busy_since is None:
            self._busy_since = now
            log.warning("server %s is full: %s; asking again for up to %.0fs", self.endpoint, message, self._timeout)
        if now - self._busy_since > self._timeout:
            self._fail(RemoteError(ErrorCode.BUSY, f"{message} (asked again for {now - self._busy_since:.0f}s)",
                                   peer=self.endpoint))
            return
        self._bye_reason = message
        self._bye_pending = True
        self._connected = False

    def _place(self, stream: int, metas: list[ArrayMeta], placement: Placement) -> dict:
        """A placed batch's arrays; none for a batch of a generation a later Hello replaced
        (dropped unread: its session's slabs may be gone)."""
        if stream != self._gen:
            return {}
        if self._slabs is None:
            raise ProtocolError("batch placed in shared memory, which this connection did not ask for")
        return self._slabs.arrays(metas, placement)

    def _on_batch(self, msg: Batch) -> None:
        if msg.stream != self._gen:
            return  # from a session a later Hello replaced
        if self._awaiting_welcome:
            # Its Welcome, and so its fingerprint, is not checked yet: never hand it over.
            self._fail(ProtocolError(f"{self.endpoint} sent batch {msg.epoch}:{msg.seq} before its Welcome"))
            return
        if (msg.epoch, msg.seq) != self._pos:
            self._out_of_order(f"batch {msg.epoch}:{msg.seq}", (msg.epoch, msg.seq))
            return
        self._received += 1
        self._items.append(Item(self._seek, "batch", msg.epoch, msg.seq, dict(msg.arrays)))
        self._undelivered += 1
        self._pos = (msg.epoch, msg.seq + 1)

    def _on_end(self, msg: EndOfEpoch) -> None:
        if msg.stream != self._gen:
            return
        if (msg.epoch, msg.batches) != self._pos:
            self._out_of_order(f"the end of epoch {msg.epoch} after {msg.batches} batches", (msg.epoch, msg.batches))
            return
        self._received += 1
        self._items.append(Item(self._seek, "end", msg.epoch, msg.batches))
        self._pos = (msg.epoch + 1, 0)
        self._history = ()  # later epochs start whole

    def _on_welcome(self, msg: Welcome) -> None:
        if msg.stream != self._gen or not self._same_sequence(msg):
            return
        self._connected = True
        self._awaiting_welcome = False
        self._bye_reason = ""
        self._busy_since = None
        self._backoff = self.BACKOFF_MIN
        self._server_heartbeat = msg.heartbeat
        self.welcome = msg
        self._actions.append(HandshakeDone())
        if msg.local is not None and self.transport == self.endpoint and self._local and self._shares_host(msg.local):
            # The same session again over the Unix socket: the Hello there replaces this
            # one, and asks for the credit this one held back.
            log.debug("server %s is on this host: reading through %s", self.endpoint, msg.local["endpoint"])
            self.transport = msg.local["endpoint"]
            if self._shared_memory:
                self._slabs = self._map_slabs(os.path.dirname(self.transport[len("ipc://"):]))
            self._close_transport()
            self._open()
        elif self._withheld:
            # Staying on TCP (another host, no socket offered): the credit the Hello held back.
            self._send(Credit(self._withheld))
            self._granted += self._withheld
            self._withheld = 0

    def _same_sequence(self, msg: Welcome) -> bool:
        """Hold to the first fingerprint heard; False (and the link fails) on another."""
        if self.fingerprint is None:
            if msg.fingerprint is not None:
                self.fingerprint = dict(msg.fingerprint)
                self._fingerprint_at = f"in what {self.endpoint} served before"
            return True
        if msg.fingerprint != self.fingerprint:
            self._fail(FingerprintMismatch(self.fingerprint, msg.fingerprint, self._fingerprint_at,
                                           f"at {self.endpoint} now"))
            return False
        return True

    def _on_error(self, msg: Error) -> None:
        if msg.code == ErrorCode.NO_SESSION:
            # The server restarted, or dropped us: ask again from where we are.
            if not self._awaiting_welcome:
                self._connected = False
                self._say_hello()
        elif msg.code == ErrorCode.BUSY and self.welcome is not None:
            self._full(msg.message)
        elif msg.fatal:
            self._fail(RemoteError(msg.code, msg.message, peer=self.endpoint))
        else:
            if msg.code == ErrorCode.DATA_LOSS:
                # Sent in order with the batches: the epoch of the next batch due is the
                # epoch whose rows were left out, however far ahead of the consumer we read.
                self.data_losses.append(msg.message)
                self.data_loss_epochs.append(self._pos[0])
            log.warning("server %s: %s [%s]", self.endpoint, msg.message, msg.code)

    def _on_bye(self, msg: Bye) -> None:
        log.warning("server %s said bye: %s", self.endpoint, msg.reason)
        self._bye_reason = msg.reason or "bye"
        self._bye_pending = True
        self._connected = False

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        if msg.stream == self._gen and not self._awaiting_welcome and msg.sent is not None and msg.sent > self._received:
            self._lost(f"it has sent {msg.sent} messages of this stream and {self._received} arrived")
        # (Any other heartbeat: hearing it is all it is for.)

    # Each message type's handler, by name (a subclass may refine one).
    _HANDLERS: dict[type, str] = {
        Batch: "_on_batch", EndOfEpoch: "_on_end", Welcome: "_on_welcome", Error: "_on_error", Bye: "_on_bye",
        Heartbeat: "_on_heartbeat",
    }
