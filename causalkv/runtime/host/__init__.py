"""The reference host: ``causalkv generate`` as a pipeline of steps, each in its own module.

`generate` runs them in order: `plan_step` (read the model's config, resolve the stage and the
cache, run `request_checks`: every fault knowable before the load), `load_step` (the model's
components), `run_step` (build the stage, run the chunk loop, calling the plugins' hooks
through `hook_calls`), `compare_step` (``--compare-bf16``) and `write_step` (the run's files),
with `report` (the metrics and the header lines). `pipeline_records` holds the records the
steps pass: the request, the run's plugins, the plan and the run's outcome. Import each name
from its module (the common ones also from `causalkv.runtime`).
"""
