"""Megatron-core GPTs at TP=2, PP=2 and EP=2, trained a few steps, synced through `hf_buckets` and
loaded into transformers' own LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM and
MixtralForCausalLM: their logits must match Megatron's (computed across the pipeline stages by
Megatron's own schedule) within bf16 tolerance.

Each layout is one spawn of gloo ranks on the CPU path that builds, trains and syncs every case
in turn; the tests then compare per case. The ranks also measure the sync's peak extra memory
(the bytes of the tensors it makes that are alive at once) against the bucket budget.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from orchestrator.adapters.megatron.convert import Family, ModelSpec, hf_config, hf_names
from orchestrator.adapters.megatron.convert.gather import unwrap_gpt
from tests.support.megatron_parallel import batches, build, schedule
from tests.support.routing import hf_routing, megatron_routing, routed_alike
from tests.support.spawn import spawn_ranks

STEPS = 3
BUCKET_BYTES = 40 << 10  # above the largest tensor, well below a stage's params
LARGEST = 2 * 128 * 64 * 2  # bytes of the largest whole tensor: the dense linear_fc1, [2·ffn, hidden] bf16
# A token's max |Δlogit|: 0.15, or 8 units in the last place of its largest bf16 logit where that
# is more (a logit in [4, 8) is held to 1/32, so 0.15 would be under 5 of them). Measured: at most
# 0.11 dense (logits of mean magnitude about 0.8), 0.19 for a Mixtral with logits up to 7.
TOLERANCE, ULPS = 0.15, 8
ROUTING_FLIPS = 3  # (token, layer) routing decisions, of 64 a MoE layer, for an MoE model (see the test)

# name: (family, build options). Each family once and each option once, to keep the spawns short:
# Qwen3 with tied embeddings (Qwen3-4B's shape; Llama keeps the untied output layer), Mixtral with
# GroupedMLP experts (Qwen3-MoE keeps SequentialMLP's).
CASES: dict[str, tuple[Family, dict[str, bool]]] = {
    "llama": (Family.LLAMA, {}),
    "qwen3 tied": (Family.QWEN3, {"tied": True}),
    "qwen3_moe": (Family.QWEN3_MOE, {}),
    "mixtral grouped": (Family.MIXTRAL, {"grouped_gemm": True}),
}
HF_CLASSES = {
    Family.LLAMA: "LlamaForCausalLM",
    Family.QWEN3: "Qwen3ForCausalLM",
    Family.QWEN3_MOE: "Qwen3MoeForCausalLM",
    Family.MIXTRAL: "MixtralForCausalLM",
}

# name: (tensor-, pipeline-, expert-parallel size, world size). In "tp2pp2ep2" the experts are
# not tensor-parallel (expert TP 1): their expert-parallel group is the dense TP group.
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "tp2": (2, 1, 1, 2),
    "pp2": (1, 2, 1, 2),
    "ep2": (1, 1, 2, 2),
    "tp2pp2ep2": (2, 2, 2, 4),
}


def _train(chunks: list[Any], optimizer: Any) -> None:
    """`STEPS` optimizer steps through Megatron's own schedule (1F1B across the PP stages).

    Megatron refuses to train an MoE layer at TP > 1 without sequence parallelism ("performance
    may degrade"), which its torch norms (no Transformer Engine or apex here) refuse in turn. In
    eval mode the MoE layer computes the same here (no dropout, jitter or aux loss), so such a
    model trains in eval mode: autograd and the optimizer are the same either way."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    moe_at_tp = bool(chunks[0].config.num_moe_experts) and ps.get_tensor_model_parallel_world_size() > 1
    for chunk in chunks:
        chunk.train(not moe_at_tp)
    for batch in batches(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(chunks, batch, forward_only=False)
        finalize_model_grads(chunks)
        optimizer.step()


def _logits(chunks: list[Any], batch: torch.Tensor) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """The last stage's logits (None elsewhere), and the experts this stage's MoE layers chose."""
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad(), megatron_routing(chunks) as routing:
        out = schedule(chunks, batch, forward_only=True)
    return (out[0] if out else None), routing


class _SyncWatch(TorchDispatchMode):
    """While on: the bytes of the tensors made and still alive (every op's new storage counts from
    the op until it is freed, on whichever thread drops it), `peak` the most at once, and
    `gathers` the all-gathers. Storages an op shares with its inputs (views, in-place ops,
    `detach`) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = self.gathers = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.held -= self._live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.gathers += str(func).startswith("c10d.allgather")
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._live or not storage.nbytes():
                continue
            self._live[key] = storage.nbytes()
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
            weakref.finalize(storage, self._free, key)
        return out


def _sync(chunks: list[Any]) -> dict[str, Any]:
    """Through `hf_buckets` with the family it reads from the config (`family_of`)."""
    from orchestrator.adapters.megatron.convert import hf_buckets, is_sync_source

    sizes = []
    with _SyncWatch() as watch:
        for bucket in hf_buckets(chunks, bucket_bytes=BUCKET_BYTES):
            sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
    state = {}
    for bucket in hf_buckets(chunks, bucket_bytes=BUCKET_BYTES):
        state.update(bucket)
    param_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    return {
        "gathers": watch.gathers,
        "sharded": _sharded_tensors(chunks),
        "state": state if is_sync_source() else {},
        "peak_extra_bytes": watch.peak,
        "largest_bucket": max(sizes),
        "buckets": len(sizes),
        "param_bytes": param_bytes,
        "synced_bytes": sum(sizes),
    }


def _sharded_tensors(chunks: list[Any]) -> int:
    """How many of this rank's tensors other ranks hold parts of (plus the one exchange of expert
    ranks an MoE model's sync starts with), counting a GroupedMLP weight once per local expert and
    not the output layer of tied embeddings (the embedding's copy, not sent)."""
    from megatron.core import parallel_state as ps

    config, gpt = chunks[0].config, unwrap_gpt(chunks[0])
    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    experts = ps.get_expert_tensor_parallel_world_size() * ep
    count = int(bool(config.num_moe_experts))
    for name, param in gpt.named_parameters():
        if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            continue
        if ".local_experts." in name:
            count += experts > 1
        elif ".mlp.experts.weight" in name:  # GroupedMLP: every local expert's block on its own
            count += (experts > 1) * config.num_moe_experts // ep
        else:
            count += tp > 1 and bool(getattr(param, "tensor_model_parallel", False))
    return count


def _rank(rank: int, world: int, port: int, out: str, layout: tuple[int, int, int]) -> None:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # this spawned process only: the router's compile costs 9 s
    result: dict[str, Any] = {}
    try:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        from orchestrator.adapters.megatron.convert import model_spec
        from orchestrator.adapters.megatron.cpu import enable_cpu_path

        enable_cpu_path()
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        tp, pp, ep = layout
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp if ep == 1 else 1,
        )
        batch = batches(STEPS + 1)[-1]  # one the model was not trained on
        tensors: dict[str, Any] = {"tokens": batch[:, :-1]}
        for case, (family, options) in CASES.items():
            start = time.perf_counter()
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            torch.manual_seed(1234)
            chunks, optimizer = build(family, tp, pp, ep, **options)
            _train(chunks, optimizer)
            synced = _sync(chunks)
            logits, routing = _logits(chunks, batch)
            source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            tensors[case] = {
                "state": synced.pop("state"),
                "logits": logits if logits is not None and source else None,
                "routing": routing if source else {},
            }
            spec = model_spec(chunks).to_dict()  # the family read from the config
            result[case] = {**synced, "spec": spec, "seconds": time.perf_counter() - start}
        torch.save(tensors, Path(out) / f"rank{rank}.pt")
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tp, pp, ep, world = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(f"convert-{request.param}")
    reports = spawn_ranks(_rank, world, out, args=((tp, pp, ep),), timeout=280)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {"name": request.param, "reports": reports, "ranks": ranks}


def _hf_logits(
    spec: ModelSpec, state: dict[str, torch.Tensor], tokens: torch.Tensor, tmp: Path
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Through `from_pretrained`, as an engine loads a checkpoint (transformers fuses the experts);
    and the experts its MoE layers chose."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = hf_config(spec)
    config.save_pretrained(tmp)
    save_file({n: t.contiguous() for n, t in state.items()}, tmp / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{spec.family}: transformers did not load the sync cleanly: {problems}"
    assert type(model).__name__ == HF_CLASSES[spec.family]
    with torch.no_grad(), hf_routing(model, batch=tokens.shape[0]) as routing:
        return model(tokens).logits.float(), routing


def _synced(layout: dict[str, Any], case: str) -> tuple[ModelSpec, dict[str, torch.Tensor], torch.Tensor]:
    """What the source ranks sent together, and Megatron's logits from the last stage."""
    spec = ModelSpec.from_dict(layout["reports"][0][case]["spec"])
    state: dict[str, torch.Tensor] = {}
    for rank in layout["ranks"]:
        for name, tensor in rank[case]["state"].items():
            assert name not in state, f"{name} was sent by two source ranks"
            state[name] = tensor
    (logits,) = [r[case]["logits"] for r in layout["ranks"] if r[case]["logits"] is not None]
    return spec, state, logits


def _tolerance(megatron: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: each token's tolerance (see TOLERANCE)."""
    ulp = torch.exp2(torch.floor(torch.log2(megatron.abs().amax(dim=-1))) - 7)  # bf16 keeps 8 bits
    return torch.clamp(ULPS * ulp, min=TOLERANCE)


def _errors(
    layout: dict[str, Any], case: str, state: dict[str, torch.Tensor], tmp: Path
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(|HF logits - Megatron logits| [batch, seq, vocab]; [batch, seq] the tokens whose logits
    must match, those before the first token of their sequence routed differently; the number of
    (token, layer) pairs routed differently)."""
    spec, _, megatron = _synced(layout, case)
    tokens = layout["ranks"][0]["tokens"]
    logits, hf_routing = _hf_logits(spec, state, tokens, tmp)
    routing = {layer: chosen for rank in layout["ranks"] for layer, chosen in rank[case]["routing"].items()}
    compared, differ = routed_alike(routing, hf_routing, tokens.shape)
    return (logits - megatron).abs(), compared, differ


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hf_logits_match_megatron(layout: dict[str, Any], case: str, tmp_path: Path) -> None:
    spec, state, megatron = _synced(layout, case)
    assert spec.family is CASES[case][0], "the family is read from Megatron's config"
    assert spec.tie_embeddings is CASES[case][1].get("tied", False)
    assert sorted(state) == sorted(hf_names(spec)), "the source ranks together send every tensor once"
    diff, compared, routed_apart = _errors(layout, case, state, tmp_path)
    errors = diff.amax(dim=-1)  # [batch, seq]: each token's worst logit
    tolerance = _tolerance(megatron)
    reports = [r[case] for r in layout["reports"]]
    peak = max(r["peak_extra_bytes"] for r in reports)
    print(
        f"\n{layout['name']} {case}: max |Δlogit| {diff.max():.4f}, mean {diff.mean():.5f}, "
        f"max of a compared token {errors[compared].max():.4f} (tolerance {tolerance[compared].min():.2f}-"
        f"{tolerance[compared].max():.2f}), routed apart {routed_apart}, compared {int(compared.sum())}/{errors.numel()} "
        f"tokens; mean |logit| {megatron.abs().mean():.3f}; "
        f"sync peak extra {peak} B, largest bucket {max(r['largest_bucket'] for r in reports)} B "
        f"of budget {BUCKET_BYTES}, params {max(r['param_bytes'] for r in reports)} B a rank; "
        f"built, trained and synced in {max(r['seconds'] for r in reports):.1f} s"
    )
    assert megatron.abs().mean() > 0.3, "logits near 0 would hide a wrong mapping"
    # A bf16 near-tie in a router can send a token to other experts in HF than in Megatron: its
    # logits move, and through attention those of the later tokens of its sequence. Those are not
    # compared; a wrong router mapping routes nearly every token apart, a wrong expert mapping
    # moves every compared token.
    assert routed_apart <= ROUTING_FLIPS, f"{routed_apart} (token, layer) pairs routed apart"
    over = errors[compared] > tolerance[compared]
    assert not over.any(), f"{int(over.sum())} compared tokens over tolerance: max |Δlogit| {errors.max():.4f}"


def _swap(state: dict[str, torch.Tensor], a: str, b: str) -> dict[str, torch.Tensor]:
    """`state` with every name holding `a` and the same name holding `b` exchanged."""
    out = dict(state)
    for name in state:
        if a in name and name.replace(a, b) in state:
            out[name], out[name.replace(a, b)] = state[name.replace(a, b)], state[name]
    return out


def _fc1_shards_whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP=2 mistake: fc1's shards concatenated as they are, each a [gate; up] of its own."""
    out = dict(state)
    for name in state:
        for gate, up in (("gate_proj", "up_proj"), ("w1", "w3")):
            if name.endswith(f".{gate}.weight"):
                other = name.replace(f".{gate}.", f".{up}.")
                (g0, g1), (u0, u1) = state[name].chunk(2), state[other].chunk(2)
                out[name], out[other] = torch.cat([g0, u0]), torch.cat([g1, u1])
    return out


def _grouped_untransposed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GroupedMLP mistake: an expert's blocks of weight1/weight2 read as SequentialMLP's
    [2·ffn, hidden] and [hidden, ffn] as they lie in memory, without the transpose."""
    out = dict(state)
    for name in state:
        if name.endswith(".w1.weight"):
            up, down = name.replace(".w1.", ".w3."), name.replace(".w1.", ".w2.")
            block1 = torch.cat([state[name].t(), state[up].t()], dim=1)  # [hidden, 2·ffn], as GroupedMLP holds it
            out[name], out[up] = block1.reshape(-1, block1.shape[0]).chunk(2)
            out[down] = state[down].t().reshape(state[down].shape)
    return out


MISTAKES = {  # layout: (case, what goes wrong, the sync with that mistake)
    "tp2": ("qwen3_moe", "fc1 shards concatenated whole", _fc1_shards_whole),
    "pp2": ("qwen3_moe", "layers without their stage's offset", lambda s: _swap(s, "layers.0.", "layers.1.")),
    "ep2": ("qwen3_moe", "experts in their rank's local order", lambda s: _swap(s, "experts.0.", "experts.2.")),
    "tp2pp2ep2": ("mixtral grouped", "fc1 shards concatenated whole", _fc1_shards_whole),
}


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True], ids=["gather", "grouped"])
def test_a_wrong_mapping_breaks_the_tolerance(layout: dict[str, Any], grouped: bool, tmp_path: Path) -> None:
    """Otherwise the match above would prove nothing about this layout's gathers, or about the
    GroupedMLP layout."""
    case, what, mistake = MISTAKES[layout["name"]]
    if grouped:
        case, what, mistake = "mixtral grouped", "GroupedMLP blocks not transposed", _grouped_untransposed
    _, state, megatron = _synced(layout, case)
    diff, compared, routed_apart = _errors(layout, case, mistake(state), tmp_path)
    errors = diff.amax(dim=-1)
    broken = int((errors > _tolerance(megatron))[compared].sum())
    print(
        f"\n{layout['name']} {case}, {what}: {broken}/{int(compared.sum())} compared tokens over tolerance, "
        f"max {errors.max():.3f}; routed apart {routed_apart}"
    )
    assert broken > 4 * ROUTING_FLIPS or routed_apart > 4 * ROUTING_FLIPS, what


@pytest.mark.slow
def test_each_tensor_is_gathered_once_and_no_rank_holds_more_than_one_bucket(layout: dict[str, Any]) -> None:
    """The allocator's peak during the sync stays within one bucket plus the tensor in flight."""
    for report in layout["reports"]:
        for case in CASES:
            r = report[case]
            assert r["largest_bucket"] <= BUCKET_BYTES
            assert r["buckets"] > 1, "a budget below the model's size must split it"
            # One bucket, plus the tensor in flight: its gathered shards and the whole they become.
            bound = BUCKET_BYTES + 2 * LARGEST
            assert r["peak_extra_bytes"] <= bound, (case, r)
            if r["synced_bytes"] > bound:  # a stage that sends less (tied, PP=2: 72 KiB) may hold it all
                assert r["peak_extra_bytes"] < r["synced_bytes"], (case, r)
            assert r["gathers"] == r["sharded"], "each sharded tensor is gathered exactly once"
