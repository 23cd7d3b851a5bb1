"""No public causalkv class name means something else in sglang's diffusion runtime."""

from __future__ import annotations

from host_names import shared_names

#: sglang's own classes that causalkv's namesake serves or mirrors in the same role
SGLANGS_OWN = {
    "CausalAttentionKVView": "the view a causal cache returns to attention (sglang's contract)",
    "CrossAttentionKVCache": "the cross-attention cache of a causal stage",
    "QVGKVQuantArgs": "the QVG cache's settings, sglang's fields plus causalkv's codec ones",
    "QVGPackedCausalKVCache": "the QVG packed causal cache",
    "ModelConfig": "a model's configuration, read by the stage",
    "ServerArgs": "the serving settings a stage reads",
}


def test_a_shared_name_is_sglangs_own_concept() -> None:
    shared = shared_names("sglang.multimodal_gen")
    other = {name: where for name, where in shared.items() if name not in SGLANGS_OWN}
    assert not other, f"causalkv public classes named like a different sglang class: {other}"


def test_the_list_of_sglangs_own_names_is_not_stale() -> None:
    """Each listed name is still shared (else the exception is no longer needed)."""
    assert set(shared_names("sglang.multimodal_gen")) >= set(SGLANGS_OWN)
