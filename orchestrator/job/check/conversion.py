"""The conversion group of `colocate check`: the trainer's model, built by megatron-core on the
meta device (names, shapes, dtypes, no memory), against what the engine loads, by the code the
run itself refuses with:

- every Megatron tensor maps to HF names (`conversion_problems`, as `colocate_megatron` and each
  rank of `colocate run` refuse);
- the model Megatron built reads as the config the engine serves (`served_problems` over
  `model_spec`, as each rank's `_conversion_shape` checks it);
- every HF checkpoint tensor of the engine's model is made exactly once, in its shape: `to_hf`
  over the meta tensors against transformers' own class for the served config, built on meta,
  its checkpoint names read by transformers' own reverse mapping (`revert_weight_conversion`);
- every param comes back after a drop, from a DDP buffer or as an extra (`expert_bias`, fp32 and
  frozen params), sorted by `MegatronTrainer`'s own `_named`.

The model is built whole in this process (a one-rank gloo group: TP = PP = EP = 1), which holds
every tensor once; the layout's TP, PP and EP only choose which rank holds which, and each rank's
names are a part of these.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.job.check.rows import Outcome, Row, SetUp
from orchestrator.job.check.trainer import job_model, served_config, served_shape

GROUP = "conversion"
_SHOWN = 4  # names listed in a row, of each kind


def rows(setup: SetUp) -> list[Row]:
    try:
        model = job_model(setup.model)
    except ConfigError as exc:
        return [_row("model", Outcome.SKIPPED, f"no model colocate run trains: {exc}")]
    try:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        read = f"{exc.name} is not importable here: the model is built by megatron-core and transformers"
        return [_row("model", Outcome.SKIPPED, read, "install colocate's [megatron] extra to check the conversion")]
    with one_rank():
        from orchestrator.adapters.megatron.build import meta_gpt

        chunks = [meta_gpt(model)]
        built = _row("model", Outcome.OK, _built(chunks))
        problems = mapping_row(chunks)
        if problems.outcome is Outcome.FAIL:
            return [built, problems]
        return [
            built,
            problems,
            served_row(chunks, model),
            coverage_row(chunks, served_config(model)),
            extras_row(chunks),
        ]


def _row(check: str, outcome: Outcome, read: str, fix: str | None = None) -> Row:
    return Row(group=GROUP, check=check, outcome=outcome, read=read, fix=fix)


@contextmanager
def one_rank() -> Iterator[None]:
    """Megatron's parallel state over a gloo group of this process alone, for the time of the
    build; none may be made already (a check runs in a process of its own)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if dist.is_initialized():
        raise RuntimeError("colocate check builds its model in a process with no process group")
    if not torch.cuda.is_available():
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _built(chunks: list[Any]) -> str:
    import megatron.core

    from orchestrator.adapters.megatron.convert.gather import unwrap_gpt

    gpt = unwrap_gpt(chunks[0])
    numel = sum(p.numel() for p in gpt.parameters())
    return (
        f"megatron-core {megatron.core.__version__} built it on the meta device: {numel:,} params in "
        f"{sum(1 for _ in gpt.parameters())} tensors, at TP = PP = EP = 1 (every tensor once)"
    )


def _listed(names: Collection[str]) -> str:
    shown = sorted(names)[:_SHOWN]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def mapping_row(chunks: list[Any]) -> Row:
    """`conversion_problems`: what the model computes that its family does not, and every tensor
    of the model that family has no counterpart for."""
    from orchestrator.adapters.megatron.convert import conversion_problems, model_spec

    problems = conversion_problems(chunks)
    if problems:
        fix = "train a model of a family and layout colocate converts (the table in the read), or convert it yourself"
        return _row("megatron → hf names", Outcome.FAIL, "; ".join(problems), fix)
    family = model_spec(chunks).family
    return _row("megatron → hf names", Outcome.OK, f"every tensor maps to HF {family} names (conversion_problems)")


def served_row(chunks: list[Any], model: Any) -> Row:
    """The run's own check at each rank: the model Megatron built against the config it serves."""
    from orchestrator.adapters.megatron.convert import model_spec
    from orchestrator.adapters.megatron.convert.served import served_problems

    problems = served_problems(model_spec(chunks), served_shape(model))
    if problems:
        fix = "make the served config.json the trained model's (or the model the config's)"
        return _row("built as served", Outcome.FAIL, "; ".join(problems), fix)
    read = "the model Megatron built computes what the config the job serves says (served_problems over model_spec)"
    return _row("built as served", Outcome.OK, read)


def converted(chunks: list[Any]) -> dict[str, list[tuple[int, ...]]]:
    """Each HF name a sync sends → the shapes it is sent in (one per time it is sent): `to_hf`
    over every tensor the sync converts (`gather._units`), on their meta tensors."""
    from orchestrator.adapters.megatron.convert import model_spec, to_hf
    from orchestrator.adapters.megatron.convert.gather import _units

    spec = model_spec(chunks)
    sent: dict[str, list[tuple[int, ...]]] = {}
    for unit in _units(chunks, mtp=False):
        for name, tensor in to_hf(unit.name, unit.tensor, spec):
            sent.setdefault(name, []).append(tuple(tensor.shape))
    return sent


def checkpoint_shapes(config: dict[str, Any]) -> tuple[str, dict[str, tuple[int, ...]]]:
    """Every checkpoint tensor transformers' class for `config` loads, and its shape: the class
    built on meta, its tensors (each once: a tied `lm_head` is the embedding's) read back through
    transformers' own reverse of its load-time fusing (what `save_pretrained` writes); and the
    class's name."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from orchestrator.adapters.engines.checkpoint import live_tensors

    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **settings)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    reverted = revert_weight_conversion(hf, dict(live_tensors(hf)))
    return type(hf).__name__, {name: tuple(tensor.shape) for name, tensor in reverted.items()}


def coverage_row(chunks: list[Any], config: dict[str, Any]) -> Row:
    sent, (kind, loaded) = converted(chunks), checkpoint_shapes(config)
    missing = set(loaded) - set(sent)
    unknown = set(sent) - set(loaded)
    twice = {name for name, shapes in sent.items() if len(shapes) > 1}
    wrong = {
        f"{name} {sent[name][0]} (the engine's {loaded[name]})"
        for name in set(sent) & set(loaded)
        if sent[name][0] != loaded[name]
    }
    found = [
        (f"never sent: {_listed(missing)}", missing),
        (f"no tensor of the engine's: {_listed(unknown)}", unknown),
        (f"sent more than once: {_listed(twice)}", twice),
        (f"in another shape: {_listed(wrong)}", wrong),
    ]
    problems = [text for text, names in found if names]
    if problems:
        fix = "the converter and the served model disagree: report it with this row, and the served config.json"
        return _row(
            "hf coverage", Outcome.FAIL, f"of the {len(loaded)} tensors {kind} loads: " + "; ".join(problems), fix
        )
    read = f"each of the {len(loaded)} checkpoint tensors transformers' {kind} loads is sent once, in its shape"
    return _row("hf coverage", Outcome.OK, read)


def extras_row(chunks: list[Any], extras: Collection[Any] | None = None) -> Row:
    """Every param rebuilt from a DDP buffer or backed up as an extra, by `MegatronTrainer`'s
    sorting (`trainer._named`). DDP's buffers are stood for by its own rule (each param that
    requires grad, `DistributedDataParallel.__init__`): DDP allocates them on the device, which
    a model on meta has none of. `extras`: the kinds backed up (default: all, as the job)."""
    from types import SimpleNamespace

    from orchestrator.adapters.megatron.trainer import ALL_EXTRAS, _named
    from states import Source

    buffers = [SimpleNamespace(params=[p for c in chunks for p in c.parameters() if p.requires_grad])]
    _, kept, sources = _named(chunks, buffers, ALL_EXTRAS if extras is None else extras)
    uncovered = [name for name, source in sources.items() if source is Source.ELSEWHERE]
    if uncovered:
        read = "; ".join(
            f"{name}: not rebuilt from the fp32 mains and not an extra (a drop would lose it)" for name in uncovered
        )
        fix = "back up every kind of extra (colocate_megatron's default extras)"
        return _row("extras backed up", Outcome.FAIL, read, fix)
    bias = [n for n in kept if n.endswith("expert_bias")]
    frozen = [n for n, t in kept.items() if n not in bias and not t.requires_grad]
    kinds = {"expert_bias": bias, "fp32": [n for n in kept if n not in bias and n not in frozen], "frozen": frozen}
    nbytes = sum(t.numel() * t.element_size() for t in kept.values())
    said = ", ".join(f"{len(names)} {kind}" for kind, names in kinds.items())
    read = f"every param comes back after a drop: {said} backed up ({nbytes / 1e6:.2f} MB pinned), the rest rebuilt"
    return _row("extras backed up", Outcome.OK, read)
