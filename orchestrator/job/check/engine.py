"""The engine group of `colocate check`: each SGLang server given (`--engine URL`), read through
its own GET routes only (`SGLangEngine`: /server_info, /model_info, /ready). Nothing is posted.

What sglang 0.5.23 lets a client see, and so what is judged (docs/check.md says why each matters):

- /server_info: the resolved `ServerArgs` (`build_server_info`: `version`, `enable_memory_saver`,
  `mem_fraction_static`, `max_total_tokens`, `tp_size`, `pp_size`, `dp_size`, `base_gpu_id`,
  `gpu_id_step`, `device`, `model_path`) and, per DP rank, `internal_states[i]["memory_usage"]`
  (its KV pool's `token_capacity`, its CUDA graphs' GB by phase), where the scheduler reports it;
- /model_info: `model_path`, `model_type`, `architectures`; not the HF config itself;
- /ready: 503 while generation is paused (`TokenizerManager.is_ready`), or the server unhealthy.

What no GET route shows: memory a killed run left released (the scheduler's `offload_tags`), and
the weight-update groups a server holds (its model runner's `_model_update_group`; only a POST
/destroy_weights_update_group would tell, and it destroys the group). Those are `skipped` rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.job.check.rows import Outcome, Row, SetUp
from orchestrator.job.check.trainer import job_model, served_shape
from orchestrator.plan.memory import GB, Plan, plan

GROUP = "engine"
LAUNCH = "docs/sglang.md's launch command"
# The phases in which the engine holds memory beside the trainer's (Plan.phases).
ENGINE_PHASES = ("update_weights", "params_dropped", "rollout")
# The weight-update group `colocate run --weight-sync broadcast` makes (job/workers/trainer_rank.py).
RUN_GROUP = "colocate_weights"


@dataclass(frozen=True, slots=True)
class Server:
    """What one server answered: its /server_info and /model_info, and whether /ready is 200."""

    url: str
    info: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    ready: bool = True
    error: str | None = None  # why it could not be read


def rows(setup: SetUp) -> list[Row]:
    """Each server's rows, then the rows of the servers together against the trainer's layout."""
    if not setup.engines:
        read = "no --engine given: no SGLang server was read"
        return [Row(group=GROUP, check="servers", outcome=Outcome.SKIPPED, read=read, fix=_GIVE)]
    servers = [read_server(url) for url in setup.engines]
    out: list[Row] = []
    for server in servers:
        out += server_rows(setup, server)
    reachable = [s for s in servers if s.error is None]
    return out + ([layout_row(setup.plan, reachable)] if reachable else [])


_GIVE = "give each SGLang server the run will drive: --engine URL (once per server)"


def read_server(url: str) -> Server:
    """GET /server_info, /model_info and /ready, through colocate's SGLang client."""
    from orchestrator.adapters.engines.sglang.client import SGLangEngine
    from orchestrator.errors import EngineError

    engine = SGLangEngine(url, connect_timeout_s=3.0, read_timeout_s=30.0, retries=1)
    try:
        info = engine.server_info()
        return Server(engine.name, info, engine.model_info(), engine.ready())
    except EngineError as exc:
        return Server(engine.name, error=exc.reason)
    finally:
        engine.close()


def server_rows(setup: SetUp, s: Server) -> list[Row]:
    def row(check: str, outcome: Outcome, read: str, fix: str | None = None) -> Row:
        return Row(group=GROUP, check=check, outcome=outcome, read=f"{s.url}: {read}", fix=fix)

    if s.error is not None:
        fix = f"start the server ({LAUNCH}), or give the URL it listens on"
        return [row("reachable", Outcome.FAIL, s.error, fix)]
    return [
        row("reachable", Outcome.OK, "answers /server_info, /model_info and /ready"),
        version_row(s, row),
        memory_saver_row(s, row),
        fit_row(setup.plan, s, row),
        served_row(setup.model, s, row),
        paused_row(s, row),
        row("released", Outcome.SKIPPED, _RELEASED, _RESTART),
        row("weight-update group", Outcome.SKIPPED, _GROUPS),
    ]


_RELEASED = (
    "sglang 0.5.23 shows no released memory on any GET route (/server_info's memory_usage holds the "
    "sizes at startup; the scheduler's offload_tags are read by none): memory a killed run left "
    "released cannot be seen, and a run's first release of it would end the server"
)
_RESTART = "after a run that was killed (SIGKILL, a lost node), restart its servers before the next run"
_GROUPS = (
    f"sglang 0.5.23 lists no weight-update group on any GET route; only POST /destroy_weights_update_group "
    f"would tell, and it destroys the group. colocate run --weight-sync broadcast destroys a {RUN_GROUP!r} "
    "left by a killed run itself, with a leftover warning"
)


def version_row(s: Server, row: Any) -> Row:
    from orchestrator.adapters.engines.sglang.client import SUPPORTED_SGLANG_TEXT, version_problem

    problem = version_problem(s.info.get("version"))
    if problem:
        return row("version", Outcome.FAIL, problem, f"install sglang {SUPPORTED_SGLANG_TEXT} on the server")
    return row("version", Outcome.OK, f"sglang {s.info['version']} (colocate supports {SUPPORTED_SGLANG_TEXT})")


def memory_saver_row(s: Server, row: Any) -> Row:
    if s.info.get("enable_memory_saver"):
        return row("memory saver", Outcome.OK, "enable_memory_saver is on: it can release memory for the trainer")
    read = f"enable_memory_saver is {s.info.get('enable_memory_saver')!r}: it cannot release memory for the trainer"
    return row("memory saver", Outcome.FAIL, read, f"restart the server with --enable-memory-saver ({LAUNCH})")


# ---- the memory fit ------------------------------------------------------------------------


def _usage(info: dict[str, Any]) -> dict[str, Any] | None:
    states = info.get("internal_states")
    usage = states[0].get("memory_usage") if isinstance(states, list) and states else None
    return usage if isinstance(usage, dict) and usage.get("token_capacity") else None


def server_plan(p: Plan, info: dict[str, Any], fraction: float | None = None) -> tuple[Plan, str]:
    """The plan redone with the server's own engine: its `mem_fraction_static` (or `fraction`),
    its KV pool (the tokens its scheduler reports, else `max_total_tokens`, else what the fraction
    leaves beside the weights, as SGLang sizes it) and its CUDA graphs where reported; and what
    the KV pool was taken from."""
    usage = _usage(info)
    tokens = int(usage["token_capacity"]) if usage else int(info.get("max_total_tokens") or 0)
    graphs = p.engine.cuda_graph_bytes
    if usage and isinstance(usage.get("graph"), dict):
        graphs = int(sum(usage["graph"].values()) * 2**30)  # SGLang reports GiB
    engine = replace(
        p.engine,
        mem_fraction_static=float(fraction if fraction is not None else info["mem_fraction_static"]),
        kv_tokens=tokens if fraction is None else 0,
        cuda_graph_bytes=graphs,
    )
    redone = plan(
        p.model, p.parallel, optimizer=p.optimizer, engine=engine, mode=p.mode,
        gpus_per_node=p.gpus_per_node, offload=p.offload,
    )  # fmt: skip
    if fraction is None and usage:
        source = f"its scheduler's KV pool of {tokens:,} tokens"
    elif fraction is None and tokens:
        source = f"its max_total_tokens {tokens:,}"
    else:
        source = f"mem_fraction_static {engine.mem_fraction_static:g} of the GPU, less the weights"
    return redone, source


def peak(p: Plan) -> tuple[int, str, int]:
    """(device bytes, phase, stage) of the busiest rank's peak while the engine holds memory."""
    return max((p.phases(r)[name][0], name, r.stage) for r in p.ranks for name in ENGINE_PHASES)


def _fits(p: Plan, info: dict[str, Any], percent: int) -> bool:
    try:
        return peak(server_plan(p, info, percent / 100)[0])[0] <= p.engine.device_bytes
    except ConfigError:  # `--offload never` cannot keep its regions beside it
        return False


def _most_that_fits(p: Plan, info: dict[str, Any]) -> float | None:
    """The largest mem_fraction_static (to 0.01) whose plan fits, or None where none does."""
    if not _fits(p, info, 1):
        return None
    low, high = 1, 101  # fits at low/100, not at high/100
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _fits(p, info, mid) else (low, mid)
    return min(low, 100) / 100


def fit_row(p: Plan, s: Server, row: Any) -> Row:
    """The plan redone with the server's KV pool: its busiest rank's peak while the engine holds
    memory (Plan.phases: update_weights, params_dropped, rollout) within one GPU."""
    if s.info.get("mem_fraction_static") is None:
        return row("memory fit", Outcome.SKIPPED, "/server_info reports no mem_fraction_static")
    fraction = float(s.info["mem_fraction_static"])
    said = f"mem_fraction_static {fraction:g} (the plan was given {p.engine.mem_fraction_static:g})"
    try:
        redone, source = server_plan(p, s.info)
    except ConfigError as exc:
        read = f"{said}: {'; '.join(map(str, exc.violations))}"
    else:
        need, phase, stage = peak(redone)
        limit = redone.engine.device_bytes
        read = (
            f"{said}; weights {redone.engine_weights / GB:.2f} GB and a KV pool of {redone.kv_cache / GB:.2f} GB "
            f"per GPU, from {source}: at {phase}, stage {stage}'s rank needs {need / GB:.2f} GB of a "
            f"{limit / GB:.2f} GB GPU"
        )
        if need <= limit:
            return row("memory fit", Outcome.OK, read)
    most = _most_that_fits(p, s.info)
    fix = (
        f"restart the server with --mem-fraction-static {most:.2f} or lower (and no --max-total-tokens above it)"
        if most is not None
        else "the engine's weights do not fit beside the trainer's param buffer: spread both over more GPUs"
    )
    return row("memory fit", Outcome.FAIL, read, fix)


# ---- the served model --------------------------------------------------------------------------


def _served_config(s: Server) -> tuple[Path | None, str]:
    """The config.json the server loaded (its model_path, where this machine can read it), and
    what was read of where it is."""
    model_path = s.model.get("model_path") or s.info.get("model_path")
    if not model_path:
        return None, "/model_info and /server_info report no model_path"
    path = Path(str(model_path))
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        return None, f"model_path {model_path!r} is no folder with a config.json on this machine"
    return path, f"model_path {model_path!r}"


def served_row(model: str, s: Server, row: Any) -> Row:
    from orchestrator.adapters.megatron.convert.served import served_problems
    from orchestrator.models import read_config

    path, where = _served_config(s)
    try:
        trainer = served_shape(job_model(model))
    except ConfigError as exc:
        return row("served config", Outcome.SKIPPED, f"no trainer to compare with: {exc}")
    if path is None:
        said = f"model_type {s.model.get('model_type')!r}, architectures {s.model.get('architectures')!r}"
        fix = "run colocate check where the server's model folder can be read (the same path)"
        return row("served config", Outcome.WARN, f"{where}; only {said} could be read", fix)
    try:
        served = read_config(json.loads(path.read_text()), source=str(path))
    except (OSError, ValueError, ConfigError) as exc:
        return row("served config", Outcome.FAIL, f"{path}: not a readable HF config ({exc})", _SERVE_SAME)
    problems = served_problems(trainer, served)
    if problems:
        return row("served config", Outcome.FAIL, f"{where}: " + "; ".join(problems), _SERVE_SAME)
    return row("served config", Outcome.OK, f"{where}: every key served_config compares is the trainer's")


_SERVE_SAME = "start the server on the trained model's own config (colocate engine-config DIR writes colocate's GPT's)"


def paused_row(s: Server, row: Any) -> Row:
    if s.ready:
        return row("paused", Outcome.OK, "/ready answers 200: generation is not paused")
    read = (
        "/ready answers 503: generation is paused (a run that failed mid-update leaves it so, or another "
        "client paused it), or the server is not healthy"
    )
    fix = "colocate run lets generation go on after its first update; to serve meanwhile, POST /continue_generation"
    return row("paused", Outcome.WARN, read, fix)


# ---- the servers against the trainer's layout --------------------------------------------------


def _width(info: dict[str, Any]) -> int:
    return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)


def layout_row(p: Plan, servers: list[Server]) -> Row:
    """Every server's TP ranks on trainer ranks (the run's per-TP-rank push), and each as wide
    as the plan's engine replica."""
    ranks = [int(s.info.get("tp_size") or 1) for s in servers]
    world, planned = p.parallel.world, p.engine.gpus or p.parallel.tp * p.parallel.pp
    sizes = " + ".join(map(str, ranks))
    gpus = [_gpus(s.info) for s in servers]
    read = f"the servers have {sum(ranks)} TP ranks ({sizes}), the trainer {world} ranks; {'; '.join(gpus)}"
    if world > 1 and sum(ranks) > world:
        fix = "drive fewer or narrower servers, or give the trainer a TP x PP x DP of at least their TP ranks"
        return Row(group=GROUP, check="layout", outcome=Outcome.FAIL, read=read + _ONE_PER_RANK, fix=fix)
    wide = [s.url for s in servers if _width(s.info) != planned]
    if wide:
        read += f"; {', '.join(wide)} span another width than the plan's engine replica ({planned} GPUs)"
        fix = "plan with --engine-gpus set to each server's TP x PP, or start the servers that wide"
        return Row(group=GROUP, check="layout", outcome=Outcome.WARN, read=read, fix=fix)
    if world > 1 and sum(ranks) < world:
        read += f"; ranks {sum(ranks)}..{world - 1} feed no server"
        fix = "add servers on the GPUs of those ranks, or drive wider ones"
        return Row(group=GROUP, check="layout", outcome=Outcome.WARN, read=read, fix=fix)
    return Row(group=GROUP, check="layout", outcome=Outcome.OK, read=read)


_ONE_PER_RANK = ": servers on the trainer's GPUs need one trainer rank per TP rank (colocate run refuses this)"


def _gpus(info: dict[str, Any]) -> str:
    """Where a server says its ranks are: GPU ids among its visible devices."""
    if str(info.get("device") or "cuda") != "cuda":
        return f"on {info.get('device')}"
    base, step = int(info.get("base_gpu_id") or 0), int(info.get("gpu_id_step") or 1)
    return f"GPUs {[base + i * step for i in range(_width(info))]} of its visible devices"
