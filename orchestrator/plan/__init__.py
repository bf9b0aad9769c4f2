"""The memory planner: what every rank holds in each phase, counted from the architecture.

    from orchestrator.plan import Parallelism, load_model, plan
    p = plan(load_model("qwen3-4b"), Parallelism(tp=2, dp=2))
    p.ranks[0].backup, p.phases(p.ranks[0])["rollout"]

Pure Python: no torch, nothing built, nothing of the adapters, the job or the CLI imported.
`MemoryProbe` turns a plan into the memory-budget guard's input (`LifecycleConfig(memory=...)`);
`GPTS` declares colocate's own models, which the job builds (`TinyGPTConfig.from_shape`).
"""

from orchestrator.plan.budget import MemoryProbe
from orchestrator.plan.memory import EngineSpec, GradDtype, OptimizerSpec, Parallelism, Plan, RankBytes, plan
from orchestrator.plan.model import LayerSpec, from_config, from_hf_config
from orchestrator.plan.presets import GPTS, PRESETS, load_model

__all__ = [
    "GPTS",
    "PRESETS",
    "EngineSpec",
    "GradDtype",
    "LayerSpec",
    "MemoryProbe",
    "OptimizerSpec",
    "Parallelism",
    "Plan",
    "RankBytes",
    "from_config",
    "from_hf_config",
    "load_model",
    "plan",
]
