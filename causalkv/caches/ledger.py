"""`ByteLedger`: the bytes a request's caches hold, all layers together, and the one peak rule.

A cache's memory is judged over a whole request: what every layer holds between calls, plus the
largest one-call buffer (a view's K/V filled from packed data, a probe's history). Every holder
(a layer's cache, a buffer several layers share) reports what it holds now (`ByteLedger.hold`),
every call that fills a one-call buffer reports its size (`ByteLedger.transient`), and the
ledger keeps the peak: the most held at once, plus the buffer filled at that moment.

Hosts read it (`peak_nbytes`) to report a request; the caches only report to it. No torch here.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["ByteLedger", "peak_nbytes"]


class ByteLedger:
    """Bytes held by every holder of one request, and their peaks.

    Attributes:
        resident_nbytes: the sum of what the holders last reported.
        peak_resident_nbytes: the largest ``resident_nbytes`` seen.
        peak_transient_nbytes: the largest one-call buffer reported.
        peak_nbytes: the largest ``resident_nbytes + the one-call buffer reported with it``.
    """

    def __init__(self) -> None:
        self._held: dict[Hashable, int] = {}
        self.resident_nbytes = 0
        self.peak_resident_nbytes = 0
        self.peak_transient_nbytes = 0
        self.peak_nbytes = 0

    def hold(self, holder: Hashable, nbytes: int) -> None:
        """``holder`` (a cache, a layer index, a shared buffer) holds ``nbytes`` now."""
        self.resident_nbytes += nbytes - self._held.get(holder, 0)
        self._held[holder] = nbytes
        self._record(0)

    def transient(self, nbytes: int) -> None:
        """A call filled a one-call buffer of ``nbytes`` (freed once its view is consumed)."""
        self.peak_transient_nbytes = max(self.peak_transient_nbytes, nbytes)
        self._record(nbytes)

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is held now (a new request)."""
        self.peak_resident_nbytes = self.peak_nbytes = self.resident_nbytes
        self.peak_transient_nbytes = 0

    def _record(self, transient: int) -> None:
        self.peak_resident_nbytes = max(self.peak_resident_nbytes, self.resident_nbytes)
        self.peak_nbytes = max(self.peak_nbytes, self.resident_nbytes + transient)


def peak_nbytes(ledgers: Iterable[ByteLedger], resident: int) -> int:
    """The peak a host reports for a request: the largest of its caches' ledgers' peaks and
    what they hold now (``resident``: a cache that reports to no ledger, such as a
    preallocated dense one, holds its most from the first chunk on)."""
    return max([resident, *(ledger.peak_nbytes for ledger in ledgers)])
