"""Stop strings applied exactly across token boundaries.

Text arrives in pieces (one per token, or less when the detokenizer holds bytes back).
A stop string may straddle pieces, so the matcher holds back the longest tail of what it
has seen that is still the beginning of some stop string, and releases it once the next
piece shows it is not. When a stop string completes, everything before it is returned and
the stop string and anything after it are not.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""  # a suffix of the text seen so far that is a proper prefix of a stop string

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `stopped` when a stop string completed."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.stopped = True
            self._held = ""
            return buf[:at]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the stream: a held partial match did not complete, so it is text."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
