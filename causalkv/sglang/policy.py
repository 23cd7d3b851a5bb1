"""sglang's QVG packing rule: a re-export of the policy object causalkv's store owns.

The rule lives in `causalkv.caches.qvg.policy` (`SGLangPolicy`, its instance `SGLANG`, and
the pure function `sglang_dense_chunks`), so causalkv's own cache can use it too
(``QVGPackedCausalKVCache(policy=SGLANG)``) without importing the bridge. No sglang import.
"""

from __future__ import annotations

from causalkv.caches.qvg.policy import SGLANG, SGLangPolicy, sglang_dense_chunks

__all__ = ["SGLANG", "SGLangPolicy", "sglang_dense_chunks"]
