"""Log the first failure of each kind and count the rest, so a bad verifier cannot flood logs."""

from __future__ import annotations

import logging
import threading


class LogOnce:
    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        self.logger.warning("%s (further %s failures are not logged)", message, kind)
