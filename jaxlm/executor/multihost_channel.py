"""The driver broadcast between nodes: rank 0 sends each step's SchedulerOutput to every follower.

Two ZMQ sockets per follower, both bound on rank 0 (``master_port + 1`` and ``+ 2``):
  * steps: ROUTER on rank 0, one DEALER per follower. Each follower says hello with its rank
    first, so rank 0 knows every peer before the first message and sends each one to each
    (no slow-joiner loss as with PUB/SUB, never blocks on an acknowledgement). Messages are
    pickles of plain Python + numpy (SchedulerOutput, the EngineConfig): the nodes trust each
    other, as the JAX coordinator already requires, so keep these ports on a private network.
  * heartbeats: the same pair on the next port, owned by one thread per side. Every
    ``HEARTBEAT_INTERVAL_S`` a follower beats and rank 0 answers; a socket that disconnects (a
    killed process) or a peer silent for ``timeout`` seconds (a hung one) is a lost node.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# How long nodes may take to find each other (loading, first connection).
STARTUP_TIMEOUT_S = 300.0
_POLL_MS = 100


def _ports(master_port: int) -> tuple[int, int]:
    return master_port + 1, master_port + 2


def _disconnected(monitor: zmq.Socket) -> bool:
    """Drains the monitor socket; True if a connection went away."""
    lost = False
    while monitor.poll(0):
        event = recv_monitor_message(monitor)["event"]
        lost |= event == zmq.EVENT_DISCONNECTED
    return lost


def _stall(last_loop: float) -> float:
    """How long this thread itself could not run (GIL, CPU) beyond its poll: not the peer's silence."""
    gap = time.monotonic() - last_loop - _POLL_MS / 1000
    return gap if gap > HEARTBEAT_INTERVAL_S else 0.0


class StepBroadcaster:
    """Rank 0's side: sends every message to every follower; watches their heartbeats
    (``lost`` says why one is gone; ``on_lost`` runs then, on the heartbeat thread)."""

    def __init__(self, master_port: int, num_followers: int, timeout_s: float,
                 on_lost: Callable[[str], None] | None = None):
        self.num_followers = num_followers
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        self._ctx = zmq.Context()
        steps_port, self._hb_port = _ports(master_port)
        self._steps = self._ctx.socket(zmq.ROUTER)
        self._steps.setsockopt(zmq.LINGER, 0)
        self._steps.bind(f"tcp://*:{steps_port}")
        self._peers: list[bytes] = []
        # Why a follower is lost (None while all live): set by the heartbeat thread.
        self.lost: str | None = None
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._hb_ready = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeats, name="jaxlm-multihost-heartbeat",
                                           daemon=True)
        self._hb_thread.start()
        self._hb_ready.wait()

    def wait_for_followers(self, timeout_s: float, what: str = "connected") -> None:
        """Blocks until every follower reported (its hello, then its end of warm-up: a barrier)."""
        deadline = time.monotonic() + timeout_s
        ranks: dict[int, bytes] = {}
        while len(ranks) < self.num_followers:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if self.lost is not None:
                raise ConnectionError(self.lost)
            if left_ms <= 0:
                raise TimeoutError(f"only {len(ranks)} of {self.num_followers} follower node(s) {what} "
                                   f"in {timeout_s:.0f} s (ranks {sorted(ranks)})")
            if self._steps.poll(min(left_ms, 1000)):
                ident, payload = self._steps.recv_multipart()
                ranks[pickle.loads(payload)] = ident
        self._peers = [ranks[r] for r in sorted(ranks)]
        logger.info("multihost: %d follower node(s) %s", len(ranks), what)

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for ident in self._peers:
            self._steps.send_multipart([ident, data], copy=False)

    def _heartbeats(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.bind(f"tcp://*:{self._hb_port}")
        self._hb_ready.set()
        last_seen: dict[int, float] = {}
        last_loop = time.monotonic()
        try:
            while not self._stop.is_set() and self.lost is None:
                stall, last_loop = _stall(last_loop), time.monotonic()
                last_seen = {rank: seen + stall for rank, seen in last_seen.items()}
                while sock.poll(_POLL_MS):
                    ident, payload = sock.recv_multipart()
                    last_seen[pickle.loads(payload)] = time.monotonic()
                    sock.send_multipart([ident, b""])
                why = None
                if _disconnected(monitor):
                    why = "a follower node closed its connection (killed or crashed)"
                now = time.monotonic()
                for rank, seen in last_seen.items():
                    if now - seen > self.timeout_s:
                        why = f"follower node {rank} sent no heartbeat for {now - seen:.1f} s (hung?)"
                if why is not None and not self._closing.is_set():  # leaving after the farewell: no loss
                    self.lost = why
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        if self.lost is not None:
            logger.error("multihost: %s", self.lost)
            if self._on_lost is not None:
                self._on_lost(self.lost)

    def close(self, farewell: Any = None) -> None:
        """Sends the followers ``farewell`` (if any): from now on their leaving is no loss; the
        heartbeats go on a moment so that they read it before rank 0's sockets close."""
        self._closing.set()
        if farewell is not None:
            self.send(farewell)
            time.sleep(0.1)
        self._stop.set()
        self._hb_thread.join(2.0)
        self._steps.close(0)
        self._ctx.term()


class StepReceiver:
    """A follower's side: receives rank 0's messages; ``on_lost`` runs (on the heartbeat
    thread) when rank 0 is gone or silent."""

    def __init__(self, master_addr: str, master_port: int, rank: int, timeout_s: float,
                 on_lost: Callable[[str], None]):
        self.rank = rank
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        self.lost: str | None = None  # why rank 0 is gone (set before on_lost runs)
        self._ctx = zmq.Context()
        steps_port, hb_port = _ports(master_port)
        self._steps = self._ctx.socket(zmq.DEALER)
        self._steps.setsockopt(zmq.LINGER, 0)
        self._steps.connect(f"tcp://{master_addr}:{steps_port}")
        self.report()  # hello
        self._stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeats, args=(f"tcp://{master_addr}:{hb_port}",),
                                           name="jaxlm-multihost-heartbeat", daemon=True)
        self._hb_thread.start()

    def report(self) -> None:
        """Tells rank 0 this node reached the next stage (connected, warmed up)."""
        self._steps.send(pickle.dumps(self.rank))

    def recv(self) -> Any:
        return pickle.loads(self._steps.recv(copy=False).buffer)

    def _heartbeats(self, address: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        beat = pickle.dumps(self.rank)
        last_answer = last_beat = time.monotonic()
        # Rank 0 may still be loading when this node starts: the first answer gets longer.
        limit = max(self.timeout_s, STARTUP_TIMEOUT_S)
        why = None
        try:
            last_loop = last_answer
            while not self._stop.is_set() and why is None:
                last_answer += _stall(last_loop)
                now = last_loop = time.monotonic()
                if now - last_beat >= HEARTBEAT_INTERVAL_S:
                    try:
                        sock.send(beat, zmq.NOBLOCK)
                    except zmq.Again:  # not connected yet
                        pass
                    last_beat = now
                while sock.poll(_POLL_MS):
                    sock.recv()
                    last_answer, limit = time.monotonic(), self.timeout_s
                if _disconnected(monitor):
                    why = "rank 0 closed its connection (killed or crashed)"
                elif time.monotonic() - last_answer > limit:
                    why = f"rank 0 answered no heartbeat for {time.monotonic() - last_answer:.1f} s (hung?)"
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        if why is not None and not self._stop.is_set():  # not after rank 0's farewell
            self.lost = why
            self._on_lost(why)

    def close(self) -> None:
        self._stop.set()
        self._hb_thread.join(2.0)
        self._steps.close(0)
        self._ctx.term()
