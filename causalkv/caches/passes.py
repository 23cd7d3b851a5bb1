"""Probe and commit: the caller's word on which pass a cache write belongs to.

A causal video model writes the K/V of the chunk it is generating on every denoising pass,
and each layer consumes the view of its write inside the same call; only the context pass
(the clean latents) writes K/V that later chunks read. A cache told which pass it serves
stores only what a later call reads:

- a **probe** (a denoising pass) returns the view over the history plus the caller's own K/V
  and stores nothing (`causalkv.caches.base.StreamCache.probe_view`);
- a **commit** (the context pass) stores the chunk, moves it straight to its tier, and drops
  at once what the next advance will drop (`CommitPass`: the next chunk's size, the pin the
  caller makes right after);
- an unmarked write keeps the dense cache's semantics.

A call marks itself (``update_and_get_attention_kv(..., probe=True)`` or ``commit=CommitPass()``),
or the caller marks every write of a pass at once through the `PassMarker` its caches share
(``with marker.probing():`` around the denoising passes, ``with marker.committing(...)``
around the context pass): the attention layers that call the caches need not know. Every
call order gets the dense cache's answer, marked or not, because the dense cache follows the
same marks (`causalkv.caches.stream.StreamState.committed`). The marker also carries the
caches' `causalkv.caches.ledger.ByteLedger`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from causalkv.caches.ledger import ByteLedger
from causalkv.errors import UsageError, check_int

__all__ = ["CommitPass", "PassMarker"]


@dataclass(frozen=True)
class CommitPass:
    """A write that is the chunk's context pass, and what the caller does next.

    Attributes:
        pin: the caller pins this chunk as the shot sink right after
            (``pin_current_chunk``), so the positions kept are those the pinned stream keeps.
        next_tokens: the size of the next chunk (None: the size of this one); the commit
            drops what an advance by that many tokens drops.
    """

    pin: bool = False
    next_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.next_tokens is not None:
            check_int("CommitPass.next_tokens", self.next_tokens, minimum=1, hint="or None",
                      error=UsageError)


class PassMarker:
    """The pass the writes of a set of caches belong to now, and their ledger.

    Attributes:
        probe: True inside `probing`: every write is a probe.
        commit: the `CommitPass` inside `committing`, else None.
        ledger: the caches' `ByteLedger` (each reports what it holds and every one-call
            buffer it fills), so ``ledger.peak_nbytes`` is their peak over a request.
    """

    def __init__(self) -> None:
        self.probe = False
        self.commit: CommitPass | None = None
        self.ledger = ByteLedger()

    def probing(self) -> AbstractContextManager[PassMarker]:
        """Writes inside are probes (denoising passes of the chunk being generated)."""
        return self._marked(True, None)

    def committing(
        self, *, pin: bool = False, next_tokens: int | None = None
    ) -> AbstractContextManager[PassMarker]:
        """Writes inside are the chunk's context pass (`CommitPass` of ``pin``, ``next_tokens``)."""
        return self._marked(False, CommitPass(pin, next_tokens))

    @contextmanager
    def _marked(self, probe: bool, commit: CommitPass | None) -> Iterator[PassMarker]:
        """The pass marked inside; an inner mark wins, and the outer one is back after it
        (a host's context pass may run inside the scope of its denoising passes)."""
        before = self.probe, self.commit
        self.probe, self.commit = probe, commit
        try:
            yield self
        finally:
            self.probe, self.commit = before
