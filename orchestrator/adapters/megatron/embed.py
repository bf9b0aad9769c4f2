"""One call from a Megatron-core trainer's model and optimizer to a `Lifecycle`.

This module wires the adapters into the controller, so it sits above both (the controller and
the adapters know each other only through `orchestrator.protocols`); that is also why the call
is a function here and not a `Lifecycle.for_megatron` classmethod, which would make the
controller import Megatron's adapters.

    lifecycle = colocate_megatron(model, optimizer, engine)                 # rematerialize
    lifecycle = colocate_megatron(model, optimizer, engine, Mode.BACKUP)
    lifecycle = colocate_megatron(model, optimizer, None, Mode.TRAIN_ONLY)

`model` is what Megatron calls the model: the list of `DistributedDataParallel` chunks (one per
virtual pipeline stage) that `get_megatron_optimizer` took. What the call chooses, and the
argument that replaces each choice:

| part | chosen | replaced by |
| --- | --- | --- |
| trainer | `MegatronTrainer(model, optimizer)`: expert_bias, fp32 and frozen params are extras | `extras=` |
| regions | torch_memory_saver where the param buffers are on a GPU, storage resizing on the CPU | `regions=` |
| setup | read from the DDP and optimizer configs (`megatron_setup`); the trainer's other flags as keywords | `**flags` |
| transport | `MegatronTransport` through `hf_llama`: Megatron GPT → HF Llama at TP = PP = 1 | `convert=`, `transport=` |
| listeners | spans to the trainer's global tracer provider, else to one the `OTEL_*` variables ask for (set as the global one: `otel_listeners`); structlog lines | `listeners=` |
| rank | torch.distributed's | `rank=` |

On a CUDA-less host it applies `enable_cpu_path()` (idempotent): the restore's cast and
all-gather run Megatron code that assumes CUDA. Building the model needs it too, so call it
yourself before you build.

Nothing moves before every check has passed: a setup Megatron's configs refuse, a model the
conversion cannot map, an engine that cannot load weights each raise `ConfigError`, naming the
problems, with the engine untouched. Once they pass, the `Lifecycle` takes the engine over
(releases its memory) as it always does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

import torch

from orchestrator.adapters.digest import DigestMethod
from orchestrator.adapters.megatron.gpt import TinyGPTConfig
from orchestrator.adapters.megatron.trainer import ALL_EXTRAS, Extra, MegatronTrainer, megatron_setup
from orchestrator.adapters.megatron.transport import Converter, MegatronTransport, per_tensor
from orchestrator.core.config import LifecycleConfig
from orchestrator.core.lifecycle import Lifecycle, require_restore_coverage
from orchestrator.errors import ConfigError
from orchestrator.protocols import LoadsWeights, MemoryRegions, RolloutEngine, WeightTransport
from orchestrator.telemetry.listeners import Listener
from states import Mode

__all__ = ["colocate_megatron", "gpt_shape", "hf_llama", "otel_listeners"]


def _gpt(chunk: Any) -> Any:
    """The GPTModel inside DDP(Float16Module(GPTModel))."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def gpt_shape(model: Sequence[Any]) -> TinyGPTConfig:
    """The shape of a Megatron GPT, read from its `TransformerConfig` and `GPTModel`: what the
    Llama conversion and an HF engine are built from (`TransformersEngine(gpt_shape(model))`)."""
    gpt = _gpt(model[0])
    config = gpt.config
    return TinyGPTConfig(
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        vocab_size=gpt.vocab_size,
        seq_len=gpt.max_sequence_length,
        num_experts=config.num_moe_experts or 0,
        rotary_base=int(gpt.rotary_base),
    )


def _not_llama(model: Sequence[Any]) -> list[str]:
    """Where a Megatron GPT computes something a Llama does not (the names would still map)."""
    import torch.nn.functional as F

    gpt = _gpt(model[0])
    config = gpt.config
    checks = {
        f"tensor_model_parallel_size={config.tensor_model_parallel_size} (the wired conversion takes whole "
        "tensors: pass convert= a converter that gathers)": config.tensor_model_parallel_size == 1,
        f"pipeline_model_parallel_size={config.pipeline_model_parallel_size} (the wired conversion has no "
        "layer offsets: pass convert=)": config.pipeline_model_parallel_size == 1 and len(model) == 1,
        f"normalization={config.normalization!r} (Llama's is RMSNorm)": config.normalization == "RMSNorm",
        "gated_linear_unit=False (Llama's MLP is SwiGLU)": config.gated_linear_unit,
        f"activation_func={getattr(config.activation_func, '__name__', config.activation_func)} (Llama's is silu)": (
            config.activation_func is F.silu
        ),
        f"position_embedding_type={gpt.position_embedding_type!r} (Llama's is rope)": (
            gpt.position_embedding_type == "rope"
        ),
        "share_embeddings_and_output_weights=True (Llama's lm_head is its own)": (
            not gpt.share_embeddings_and_output_weights
        ),
    }
    return [problem for problem, ok in checks.items() if not ok]


def hf_llama(model: Sequence[Any], trainer: MegatronTrainer) -> Converter:
    """The conversion wired today: Megatron GPT → HF Llama, one whole tensor at a time
    (`orchestrator.adapters.megatron.convert.to_hf`), for tensor- and pipeline-parallel size 1.

    Raises ConfigError naming every problem before anything is sent: where the model is not a
    Llama (normalization, MLP, activation, positions, tied output, TP or PP > 1), and every sync
    tensor `to_hf` cannot map (MoE experts and routers among them). Checked on meta tensors.
    """
    from orchestrator.adapters.megatron.convert import to_hf

    problems = [f"not an HF Llama: {problem}" for problem in _not_llama(model)]
    if problems:
        raise ConfigError(problems)
    convert = partial(to_hf, cfg=gpt_shape(model))
    for name, tensor in trainer.sync_shapes():
        try:
            convert(name, tensor)
        except ValueError as error:
            problems.append(str(error))
    if problems:  # a model-wide problem (MoE, say) is raised by every tensor it touches: name it once
        raise ConfigError(list(dict.fromkeys(problems)))
    return per_tensor(convert)


def otel_listeners(rank: int) -> list[Listener]:
    """A tracing listener, then a structlog listener.

    Spans go to the global tracer provider when one was set (the trainer's own). Otherwise the
    `OTEL_*` variables decide: where they ask for export, a provider of role `rank` is made and
    set as the global one, so that the adapters' own spans (`rank.cast`, `rank.bucket`, ...)
    join the lifecycle's; OpenTelemetry sets it once for the process's life, and a later call
    finds it set. Where they ask for nothing, spans go to the global no-op provider.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from orchestrator.telemetry.logs import LoggingListener
    from orchestrator.telemetry.tracing import TracingListener, configure_tracing

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        configured = configure_tracing(rank=rank, role="rank")
        if configured is not None:
            trace.set_tracer_provider(configured)
            provider = trace.get_tracer_provider()  # another thread may have set one first
    return [TracingListener(provider), LoggingListener()]


def _regions(trainer: MegatronTrainer) -> MemoryRegions:
    on_gpu = any(t.is_cuda for t in trainer.region_tensors()["param_buffer"])
    if on_gpu:
        from orchestrator.adapters.regions.tms import TorchMemorySaverRegions

        return TorchMemorySaverRegions(trainer.region_tensors)
    from orchestrator.adapters.regions.storage import StorageRegions

    return StorageRegions(trainer.region_tensors)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def colocate_megatron(
    model: Sequence[Any] | Any,
    optimizer: Any,
    engine: RolloutEngine | None,
    mode: Mode | str = Mode.REMATERIALIZE,
    *,
    convert: Converter | None = None,
    transport: WeightTransport | None = None,
    bucket_bytes: int = 64 << 20,
    regions: MemoryRegions | None = None,
    listeners: Sequence[Listener] | None = None,
    extras: Collection[Extra] = ALL_EXTRAS,
    digest: DigestMethod | None = None,
    verify_cycles: int = 2,
    rank: int | None = None,
    **flags: bool,
) -> Lifecycle:
    """The `Lifecycle` for one rank of a Megatron-core trainer (see the module docstring).

    `engine` must load weights (`update_weights(named, version)`, `LoadsWeights`) unless
    `transport` is given; it is None in `Mode.TRAIN_ONLY`. `flags` are the `TrainingSetup` flags
    Megatron does not hold (`compute_advantages`, `lora`, `keep_old_actor`, ...); those it holds
    are read from its configs and refused as keywords.

    Raises ConfigError, naming every problem, with the engine untouched: a setup the mode refuses,
    a flag Megatron's configs hold, an engine that loads no weights, a model the Llama conversion
    cannot map (when `convert` and `transport` are not given), a param no restore path covers.
    """
    model = list(model) if isinstance(model, Sequence) else [model]  # Megatron's list of chunks, or one
    if not torch.cuda.is_available():
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
    rank = _rank() if rank is None else rank
    if mode not in Mode.__members__.values():
        raise ConfigError([f"mode must be one of {', '.join(Mode)}, got {mode!r}"])
    config = LifecycleConfig(
        mode=Mode(mode),
        rank=rank,
        verify_cycles=verify_cycles,
        setup=megatron_setup(model, optimizer, **flags),
    )
    if digest is None:
        digest = DigestMethod.DEVICE if torch.cuda.is_available() else DigestMethod.SHA256
    trainer = MegatronTrainer(model, optimizer, extras=extras, digest=digest)
    if config.mode is not Mode.TRAIN_ONLY:
        require_restore_coverage(trainer.layout())  # before regions re-home anything
    if engine is not None and transport is None:
        if not isinstance(engine, LoadsWeights):
            raise ConfigError([f"engine {engine.name!r} has no update_weights(named, version): pass transport="])
        convert = hf_llama(model, trainer) if convert is None else convert
        transport = MegatronTransport(trainer, engine, convert=convert, bucket_bytes=bucket_bytes)
    return Lifecycle(
        config=config,
        trainer=trainer,
        regions=_regions(trainer) if regions is None else regions,
        engine=engine,
        transport=transport,
        listeners=otel_listeners(rank) if listeners is None else tuple(listeners),
    )
