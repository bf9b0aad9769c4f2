"""The CPU path: megatron-core 0.16.1 DDP + DistributedOptimizer on a CUDA-less host, over gloo.

megatron-core assumes CUDA in five ways on the GPT / DDP / distributed-optimizer path:

1. ``torch.cuda.current_device()`` as the device of param/grad buffers, router buffers, masks;
2. ``device="cuda"`` factories (found-inf flag, grad-norm scalars, causal mask);
   both are redirected per module: the megatron modules listed in ``_DEVICE_MODULES`` get a view
   of ``torch`` as their global ``torch``, whose ``cuda.current_device()`` is the CPU and whose
   factories map a CUDA device to the CPU. Global ``torch`` and every other module are untouched.
   The list covers train, finalize, step, cast and all-gather (EP 1 and 2), and Megatron's pipeline
   schedules (TP, PP 2); another path that
   fails with "Torch not compiled with CUDA enabled" needs its module added.
3. ``Tensor.type()`` compared with ``"torch.cuda.BFloat16Tensor"`` etc., to sort params into
   float16 and fp32 groups (``DistributedOptimizer.__init__``) and in an assert of the grad clipper.
   A method cannot be scoped to a module, so it is scoped in time: only while those two functions
   run does ``Tensor.type()`` of a CPU tensor answer the CUDA name.
4. The RNG tracker (``tensor_parallel.random``) forks the CUDA generator; on a CPU build
   ``torch.cuda.manual_seed`` is queued forever and reading its state raises. Its state get/set
   and seeding go to the CPU default generator instead.
5. ``Tensor.cuda()``: with tied embeddings, or MTP layers, at PP > 1 the last stage holds a copy of
   the word embeddings, which ``LanguageModule.setup_embeddings_and_output_layer`` moves to the
   GPU before the all-reduce that makes it equal to the first stage's. Scoped in time like (3):
   only while that method runs is a CPU tensor's ``.cuda()`` the tensor itself.

Also two upstream import bugs. ``moe_utils`` defines ``te_general_gemm`` only when Transformer Engine
imports, yet the router reads it unconditionally; without TE it is set to ``None``. And
``multi_latent_attention`` sets its ``HAVE_TE`` when ``megatron.core.extensions.transformer_engine``
imports, which it does without TE (its classes are then ``MagicMock``s), so building an MLA layer
calls ``isinstance(linear_proj, <a MagicMock>)`` and raises; without TE its flag is set to ``False``.

``enable_cpu_path()`` raises where CUDA is available instead of doing nothing: there it would
quietly move training to the host, and 0.19.2 runs on the GPU as it is, so a call there is a bug.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["enable_cpu_path"]

_CPU = torch.device("cpu")
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor")
_DEVICE_MODULES = (  # each one was seen to fail without the view (ablation, 0.16.1)
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.transformer.moe.router",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",  # MLA's YaRN: its frequencies' device
    "megatron.core.pipeline_parallel.schedules",  # PP > 1: the token count, the p2p shapes
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
    "megatron.core.transformer.multi_token_prediction",  # MTP: its loss tracker's device
    "megatron.core.transformer.experimental_attention_variant.dsa",  # DSA: its indexer-loss tracker's
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # save: the D2H copies' synchronize
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # save: the failure flag's device
)
_applied = False


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        dev = kwargs.get("device")
        if isinstance(dev, int) or str(dev).startswith("cuda"):  # an int is a CUDA ordinal
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return make


class _CudaView(types.ModuleType):
    """``torch.cuda`` as a redirected module sees it; what is not here is the real one."""

    current_device = staticmethod(lambda: _CPU)
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    synchronize = staticmethod(lambda device=None: None)  # CPU ops finish before they return

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """``torch`` as a redirected module sees it: CUDA devices are the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaView("torch.cuda")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    real = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = real(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":  # a cast, or not a CPU tensor
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _cuda_is_host() -> Iterator[None]:
    real = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.device.type == "cpu" else real(self, *args, **kwargs)

    torch.Tensor.cuda = cuda  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = real  # type: ignore[method-assign]


def _scoped(
    context: Callable[[], contextlib.AbstractContextManager[None]], fn: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps __wrapped__, so the original stays reachable
    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    return call


def enable_cpu_path() -> None:
    """Apply the five CPU redirections and the two import fixes; idempotent."""
    global _applied
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_path() is for CUDA-less hosts; megatron runs as it is on a GPU")
    if _applied:
        return
    view = _TorchView()
    for name in _DEVICE_MODULES:  # (1) and (2)
        importlib.import_module(name).torch = view  # type: ignore[attr-defined]

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    dist_opt = distrib_optimizer.DistributedOptimizer  # (3)
    dist_opt.__init__ = _scoped(_cuda_type_names, dist_opt.__init__)
    clip = _scoped(_cuda_type_names, clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # the name optimizer.py calls
    # (4) fork() swaps generator states through these; add() and seeding use the view's cuda.
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    setup = LanguageModule.setup_embeddings_and_output_layer  # (5)
    LanguageModule.setup_embeddings_and_output_layer = _scoped(_cuda_is_host, setup)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE:  # the module's own flag says TE is there when only its mocks are
        multi_latent_attention.HAVE_TE = False
    _applied = True
