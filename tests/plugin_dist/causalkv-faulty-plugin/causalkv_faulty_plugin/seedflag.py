"""A plugin whose stage declares ``--seed``, a flag of ``causalkv generate`` itself."""

from dataclasses import dataclass

from causalkv.hooks import StageRegistration, hookimpl
from causalkv.options import StageOptions, option


@dataclass(frozen=True)
class SeedOptions(StageOptions):
    title = "seed knobs"
    seed: int = option(0, flag="--seed", type=int, help="a flag that clashes on purpose")


@hookimpl
def causalkv_register_stages():
    return [StageRegistration("seeded", "causalkv.stages.wan:WanCausalDMDStage", models=("SeededPipeline",),
                              options=SeedOptions)]
