"""One kvchat per data folder: two windows writing one database would mark each other's live replies
incomplete. The first holds a lock file in the folder (Qt's QLockFile: a lock whose process is gone is
taken over) and listens on a local socket; a second start asks the first to come to the front and ends."""

from __future__ import annotations

import hashlib
from pathlib import Path

from PySide6.QtCore import QLockFile
from PySide6.QtNetwork import QLocalServer, QLocalSocket

LOCK_NAME = "kvchat.lock"
WAKE = b"show\n"


def _socket_name(data: Path) -> str:
    return "kvchat-" + hashlib.sha256(str(data.resolve()).encode()).hexdigest()[:16]


class SingleInstance:
    """The lock on one data folder, and the first instance's ear for the ones started after it."""

    def __init__(self, data: Path):
        self.data = Path(data)
        self.lock = QLockFile(str(self.data / LOCK_NAME))
        self.lock.setStaleLockTime(0)  # stale only when its process is gone, however old
        self.server: QLocalServer | None = None

    def acquire(self) -> bool:
        """True when this is the only kvchat on the folder now (the lock is ours)."""
        self.data.mkdir(parents=True, exist_ok=True)
        return self.lock.tryLock(200)

    def holder(self) -> int | None:
        """The process id of the kvchat holding the folder, when it can be read."""
        info = self.lock.getLockInfo()  # PySide6: (pid, host, app), or a falsy first item when unreadable
        pid = info[0] if isinstance(info, tuple) and info else None
        return pid if isinstance(pid, int) and pid > 0 else None

    def listen(self, window) -> None:
        """Bring `window` to the front whenever another start on this folder asks."""
        name = _socket_name(self.data)
        QLocalServer.removeServer(name)  # a socket left by a kvchat that crashed
        self.server = QLocalServer()
        self.server.newConnection.connect(lambda: self._woken(window))
        self.server.listen(name)

    def _woken(self, window) -> None:
        conn = self.server.nextPendingConnection()  # a connection is the whole message: come forward
        if conn is not None:
            conn.disconnected.connect(conn.deleteLater)
        window.showNormal()
        window.raise_()
        window.activateWindow()

    def wake_other(self) -> bool:
        """Ask the kvchat holding the folder to come to the front; False when it did not answer."""
        sock = QLocalSocket()
        sock.connectToServer(_socket_name(self.data))
        if not sock.waitForConnected(1000):
            return False
        sock.write(WAKE)
        sock.waitForBytesWritten(1000)
        sock.disconnectFromServer()
        return True

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
        self.lock.unlock()
