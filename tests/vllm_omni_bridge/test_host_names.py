"""No public causalkv class name means something else in vLLM-Omni or in the vLLM it runs on."""

from __future__ import annotations

from host_names import shared_names

#: vLLM's and vLLM-Omni's own classes that causalkv's namesake mirrors in the same role
THEIR_OWN = {
    "ModelConfig": "a model's configuration (vllm.config), what causalkv's resolver reads",
    "Segment": "a run of token positions attention reads (vLLM-Omni's piecewise attention)",
}
PACKAGES = ("vllm_omni", "vllm.config", "vllm.v1")


def test_a_shared_name_is_the_hosts_own_concept() -> None:
    shared = shared_names(*PACKAGES)
    other = {name: where for name, where in shared.items() if name not in THEIR_OWN}
    assert not other, f"causalkv public classes named like a different vLLM/vLLM-Omni class: {other}"


def test_the_list_of_their_own_names_is_not_stale() -> None:
    assert set(shared_names(*PACKAGES)) >= set(THEIR_OWN)
