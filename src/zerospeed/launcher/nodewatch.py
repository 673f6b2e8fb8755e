"""Which node went away: one TCP connection between node 0's launcher and every other node's launcher.

torchrun's static rendezvous does not say which node failed: when a node dies, the ranks elsewhere only see
"connection closed" inside a collective. So the node launchers keep a line to node 0's launcher (on
``master_port + 1``): each side says ``exit CODE MESSAGE`` when it ends. A connection that closes without
that line means the peer launcher died (killed, host down); a non-zero code means its ranks failed.
Either way ``on_event(node, text)`` is called once, and the launcher stops its own ranks and names that
node. Node 0 also names the nodes that have not connected within ``join_timeout`` seconds.

Each side also sends ``alive`` every ``HEARTBEAT_S``: a link cut silently (down, or packets dropped, so no
FIN or RST ever comes) shows as a peer not heard from. That alone stops nothing (a network hiccup must not
end a job); when this node's ranks then fail - typically a collective timeout - ``blame_silent()`` names the
silent node as the likely cause instead of the local rank that timed out.

Used with a fixed ``--nnodes`` only: under ``--elastic_training`` nodes may come and go.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

WATCH_PORT_OFFSET = 1
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 3.0  # a peer not heard from for this long is named when this node's ranks fail
EventHandler = Callable[[int, str], None]


def _send_line(sock: socket.socket, text: str) -> None:
    try:
        sock.sendall((text.replace("\n", " ") + "\n").encode("utf-8"))
    except OSError:
        pass


def _read_lines(sock: socket.socket, heard: Callable[[], None] = lambda: None) -> tuple[list[str], bool]:
    """Read until the peer closes: (lines, True) - or stop at the first ``exit`` line: (lines, False).
    ``heard()`` is called for every chunk received; ``alive`` heartbeats are not kept."""
    buf = b""
    lines: list[str] = []
    while True:
        try:
            chunk = sock.recv(4096)
        except OSError:
            return lines, True
        if not chunk:
            return lines, True
        heard()
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"alive":
                continue
            lines.append(line.decode("utf-8", "replace"))
            if lines[-1].startswith("exit "):
                return lines, False


def describe(lines: list[str], closed: bool, who: str) -> str | None:
    """What a peer's last words mean: ``None`` for a clean exit (code 0), else a sentence naming ``who``."""
    for line in lines:
        if line.startswith("exit "):
            code, _, message = line[5:].partition(" ")
            if code == "0":
                return None
            return f"{who} failed (exit code {code}): {message}" if message else f"{who} failed (exit code {code})"
    if closed:
        return f"{who} lost: its launcher's connection closed without an exit report (killed, or the host went down)"
    return None


class NodeWatch:
    """One node launcher's side; ``start()`` then ``finish(code, message)``. Thread-safe, events once."""

    def __init__(self, node_rank: int, nnodes: int, master_addr: str, master_port: int, host: str,
                 on_event: EventHandler, join_timeout: float = 600.0) -> None:
        self.node_rank, self.nnodes, self.host = node_rank, nnodes, host
        self.addr, self.port = master_addr, master_port + WATCH_PORT_OFFSET
        self.on_event, self.join_timeout = on_event, join_timeout
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}
        self._hosts: dict[int, str] = {0: master_addr}
        self._done = threading.Event()
        self._fired = False
        self._server: socket.socket | None = None
        self._heard: dict[int, float] = {}
        self._send_lock = threading.Lock()
        self.event: str | None = None

    def start(self) -> None:
        if self.nnodes < 2:
            return
        target = self._serve if self.node_rank == 0 else self._connect
        if self.node_rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("", self.port))
            server.listen(self.nnodes)
            self._server = server
        threading.Thread(target=target, daemon=True, name="zerospeed-nodewatch").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="zerospeed-nodewatch-heartbeat").start()

    def _heartbeat(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            with self._lock:
                peers = list(self._peers.values())
            for sock in peers:
                with self._send_lock:
                    _send_line(sock, "alive")

    def silent(self, after_s: float = SILENT_AFTER_S) -> list[tuple[int, float]]:
        """``(node, seconds)`` for each connected peer not heard from for more than ``after_s``."""
        now = time.monotonic()
        with self._lock:
            heard = dict(self._heard)
        return [(node, now - t) for node, t in sorted(heard.items()) if now - t > after_s]

    def blame_silent(self, after_s: float = SILENT_AFTER_S) -> None:
        """This node's ranks failed and no peer reported anything: name a silent peer as the cause."""
        quiet = self.silent(after_s)
        if self.event is None and quiet:
            node, seconds = quiet[0]
            self.event = (f"{self._who(node)} unreachable: nothing heard from its launcher for {seconds:.0f} s "
                          "(link down, packets dropped, or the host hung)")

    def _fire(self, node: int, text: str | None) -> None:
        if text is None or self._done.is_set():
            return
        with self._lock:
            if self._fired:
                return
            self._fired = True
            self.event = text
        self.on_event(node, text)

    def _who(self, node: int) -> str:
        host = self._hosts.get(node)
        return f"node {node}" + (f" ({host})" if host else "")

    def _mark_heard(self, node: int) -> None:
        with self._lock:
            self._heard[node] = time.monotonic()

    def _watch(self, node: int, sock: socket.socket) -> None:
        self._mark_heard(node)
        lines, closed = _read_lines(sock, lambda: self._mark_heard(node))
        self._fire(node, describe(lines, closed, self._who(node)))

    def _serve(self) -> None:
        assert self._server is not None
        deadline = time.monotonic() + self.join_timeout
        self._server.settimeout(0.5)
        while not self._done.is_set() and len(self._peers) < self.nnodes - 1:
            if time.monotonic() > deadline:
                missing = [n for n in range(1, self.nnodes) if n not in self._peers]
                self._fire(missing[0], f"node(s) {', '.join(map(str, missing))} did not join within "
                           f"{self.join_timeout:.0f} s (their launch failed or never started?)")
                return
            try:
                conn, _ = self._server.accept()
            except (socket.timeout, OSError):
                continue
            conn.settimeout(10.0)
            try:
                first, _, more = conn.recv(4096).decode("utf-8", "replace").partition("\n")
                hello = first.split()
                node, host = int(hello[1]), hello[2] if len(hello) > 2 else ""
            except (OSError, ValueError, IndexError):
                conn.close()
                continue
            conn.settimeout(None)
            with self._lock:
                self._peers[node] = conn
                self._hosts[node] = host
            rest = hello[3:]  # an early failure report arrives in the hello: "node I HOST exit CODE MSG"
            said = [" ".join(rest)] if rest and rest[0] == "exit" else [ln for ln in more.split("\n") if ln]
            if any(line.startswith("exit ") for line in said):  # it ended already
                self._fire(node, describe(said, False, self._who(node)))
                continue
            threading.Thread(target=self._watch, args=(node, conn), daemon=True).start()

    def _connect(self) -> None:
        deadline = time.monotonic() + self.join_timeout
        while not self._done.is_set():
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self._fire(0, f"node 0 ({self.addr}) unreachable: no launcher listening on "
                               f"{self.addr}:{self.port} within {self.join_timeout:.0f} s")
                    return
                time.sleep(0.2)
        else:
            return
        sock.settimeout(None)
        _send_line(sock, f"node {self.node_rank} {self.host}")  # the hello first: no heartbeat before it
        with self._lock:
            self._peers[0] = sock
        self._watch(0, sock)

    def finish(self, code: int, message: str = "") -> None:
        """Tell the peers how this node ended, then close (a later peer event is ignored)."""
        self._done.set()
        with self._lock:
            peers = list(self._peers.values())
        for sock in peers:
            with self._send_lock:
                _send_line(sock, f"exit {code} {message}".rstrip())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._server is not None:
            self._server.close()


def report_early_failure(master_addr: str, master_port: int, node_rank: int, host: str, code: int,
                         message: str, timeout: float = 5.0) -> None:
    """A node that fails before starting (bad script path) tells node 0 at once, if it can reach it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((master_addr, master_port + WATCH_PORT_OFFSET), timeout=1.0) as sock:
                _send_line(sock, f"node {node_rank} {host} exit {code} {message}")
                return
        except OSError:
            time.sleep(0.2)
