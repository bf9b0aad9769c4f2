"""`RolloutEngine` over SGLang's HTTP server (checked against sglang 0.5.23's source: docs/sglang.md).

- `wire`: SGLang's weight wire format (the flattened bucket, `MultiprocessingSerializer`'s bytes),
  reimplemented without importing sglang.
- `http`: `SGLangHTTP`, requests to one server: the session, retries, client spans, error shapes.
- `memory`: `SGLangMemory`, the memory routes of one server and the tags it released.
- `weights`: `SGLangWeightUpdates`, the weight-update routes of one server (session, bucket, broadcast).
- `client`: `SGLangEngine`, one server as a `RolloutEngine`: the routes colocate calls, and `generate`.
- `broadcast`: `WeightBroadcaster` and `weight_update_group`, for servers off the trainer's GPUs.
- `group`: `SGLangGroup`, every server of a job as one engine, and the job's rollout over them.

`sglang_schema.json` beside them records SGLang's request classes (scripts/extract_sglang_schema.py).
"""

from orchestrator.adapters.engines.sglang.broadcast import WeightBroadcaster, weight_update_group
from orchestrator.adapters.engines.sglang.client import SUPPORTED_SGLANG, Generation, SGLangEngine, version_problem
from orchestrator.adapters.engines.sglang.group import SGLangGroup, url_problems
from orchestrator.adapters.engines.sglang.wire import flattened_bucket, serialize

__all__ = [
    "SUPPORTED_SGLANG",
    "Generation",
    "SGLangEngine",
    "SGLangGroup",
    "WeightBroadcaster",
    "flattened_bucket",
    "serialize",
    "url_problems",
    "version_problem",
    "weight_update_group",
]
