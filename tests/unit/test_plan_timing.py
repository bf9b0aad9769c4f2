"""The time model (orchestrator/plan/timing.py): each phase is its links' bytes over their rates, the
bound is the longest term, and a layout's groups cross the links their ranks' nodes imply."""

from __future__ import annotations

from orchestrator.plan.figures import Link, LinkRates
from orchestrator.plan.memory import Parallelism, Plan, plan
from orchestrator.plan.model import Kind, stage_tensors
from orchestrator.plan.offload import copied_bytes
from orchestrator.plan.presets import GPTS, load_model
from orchestrator.plan.timing import StageTime, predict
from states import Mode, Offload, Region

GLM5, QWEN3_4B = load_model("glm-5"), load_model("qwen3-4b")
GLM5_LAYOUT = Parallelism(tp=8, pp=4, ep=16, etp=1, dp=2, pp_layers=(19, 20, 20, 19))


def _llama(**kw: object) -> Plan:
    return plan(GPTS["llama-1b"], Parallelism(), offload=Offload.ALWAYS, **kw)  # type: ignore[arg-type]


def _links(st: StageTime, phase: str) -> dict[str, Link]:
    return {t.what: t.link for t in st.phases[phase].terms}


def test_a_phase_is_its_bytes_over_the_rate_and_the_bound_names_the_link() -> None:
    p = _llama()
    r = p.ranks[0]
    rates = LinkRates(to_host_gbps=40.0, from_host_gbps=30.0)
    st = predict(p, rates)[0]
    pause = st.phases["pause_grads"]
    moved = copied_bytes(p, r, Region.DEFAULT)
    assert moved == r.mains + r.adam
    assert [(t.link, t.bytes) for t in pause.terms] == [(Link.TO_HOST, moved)]  # llama has no extras
    assert pause.seconds == moved / (40.0 * 1e9)
    assert pause.bound is not None and pause.bound.link is Link.TO_HOST and pause.bound.bytes == moved
    restore = st.phases["restore"]
    assert restore.bound is not None and restore.bound.link is Link.FROM_HOST
    # The cast reads the mains (4 B a param) and writes bf16 (2 B): a copy of 3 B a param.
    cast = next(t for t in restore.terms if t.what.startswith("cast"))
    assert cast.link is Link.DEVICE and cast.bytes == (r.mains + r.mains // 2) // 2
    assert restore.seconds == moved / (30.0 * 1e9) + cast.bytes / (rates.device_copy_gbps * 1e9)
    assert st.phases["drop_params"].terms == () and st.phases["drop_params"].bound is None


def test_tp1_on_one_gpu_pushes_by_one_device_copy_and_crosses_no_nvlink_or_infiniband() -> None:
    p = _llama()
    st = predict(p)[0]
    update = st.phases["update_weights"]
    assert [(t.link, t.bytes) for t in update.terms] == [(Link.DEVICE, p.engine_weights)]
    every = {t.link for x in st.phases.values() for t in x.terms}
    assert Link.NVLINK not in every and Link.IB not in every


def test_tp_gathers_the_dense_tensors_whole_and_dp_all_gathers_the_params_on_nvlink_within_a_node() -> None:
    p = plan(QWEN3_4B, Parallelism(tp=2, dp=2), gpus_per_node=8)
    st = predict(p)[0]
    layers = p.parallel.stages(QWEN3_4B)[0]
    own = stage_tensors(QWEN3_4B, layers, first=True, last=True, tp=2, ep=1, etp=1)
    whole = stage_tensors(QWEN3_4B, layers, first=True, last=True, tp=1, ep=1, etp=1)
    dense = [sum(2 * t.numel for t in ts if t.kind is not Kind.EXPERT_BIAS) for ts in (own, whole)]
    gather = next(t for t in st.phases["update_weights"].terms if t.what.startswith("TP gather"))
    assert (gather.link, gather.bytes) == (Link.NVLINK, dense[1] - dense[0])
    all_gather = next(t for t in st.phases["restore"].terms if "all-gather over DP" in t.what)
    assert (all_gather.link, all_gather.bytes) == (Link.NVLINK, dense[0] // 2)
    assert Link.IB not in {t.link for x in st.phases.values() for t in x.terms}


def test_dp_across_nodes_all_gathers_over_infiniband_while_tp_stays_on_nvlink() -> None:
    # Two GPUs a node: TP pairs {0,1} and {2,3} each on a node, DP pairs {0,2}, {1,3} across them.
    st = predict(plan(QWEN3_4B, Parallelism(tp=2, dp=2), gpus_per_node=2))[0]
    assert _links(st, "restore")["param all-gather over DP"] is Link.IB
    assert _links(st, "update_weights")["TP gather of the dense tensors"] is Link.NVLINK


def test_glm5_at_the_seed_layout_gathers_over_infiniband_and_names_each_phases_bound() -> None:
    p = plan(GLM5, GLM5_LAYOUT, gpus_per_node=4)
    stages = predict(p)
    assert len(stages) == 4
    for st in stages:
        r = p.ranks[st.stage]
        assert _links(st, "update_weights")["TP gather of the dense tensors"] is Link.IB  # TP8 over 4-GPU nodes
        update = st.phases["update_weights"]
        assert update.bound is not None and update.bound.link is Link.IB
        pause = st.phases["pause_grads"]
        assert pause.bound is not None and (pause.bound.link, pause.bound.bytes) == (Link.TO_HOST, r.optimizer_state)
        # Expert DP is 1: nothing to all-gather of the experts.
        assert "expert param all-gather over expert DP" not in _links(st, "restore")
        # The engine GPU's share arrives by the three links, and adds up to its weights.
        share = [t.bytes for t in update.terms if t.what == "the engine's share of the model"]
        assert len(share) == 3 and abs(sum(share) - p.engine_weights) <= 2


def test_backup_mode_stashes_and_restores_the_bf16_params_and_casts_nothing() -> None:
    p = _llama(mode=Mode.BACKUP)
    r = p.ranks[0]
    st = predict(p)[0]
    assert _links(st, "pause_grads")["stash: every bf16 param"] is Link.TO_HOST
    back = {t.what: t for t in st.phases["restore"].terms}
    assert back["every bf16 param"].bytes == r.param_buffer
    assert not any(what.startswith("cast") for what in back)


def test_a_kept_default_moves_nothing_at_pause_and_streams_no_moments() -> None:
    p = _llama()
    st = predict(p, keep=frozenset({Region.DEFAULT, Region.GRAD_BUFFER}), train_seconds=0.1)[0]
    assert st.phases["pause_grads"].terms == ()
    assert st.moments.term is None and st.moments.visible == 0.0


def test_the_moments_stream_shows_what_the_train_does_not_hide_and_says_when_that_is_unknown() -> None:
    p = _llama()
    r = p.ranks[0]
    rates = LinkRates(from_host_gbps=25.0)
    stream = r.adam / (25.0 * 1e9)
    assert predict(p, rates)[0].moments.visible is None
    assert predict(p, rates, train_seconds=stream / 4)[0].moments.visible == stream - stream / 4
    assert predict(p, rates, train_seconds=stream * 2)[0].moments.visible == 0.0
    st = predict(p, rates)[0]
    assert st.moments.term is not None and st.moments.term.bytes == r.adam
    assert st.restore_with_stream == st.phases["restore"].seconds - stream


def test_a_faster_link_shortens_only_the_phases_on_it() -> None:
    p = plan(GLM5, GLM5_LAYOUT, gpus_per_node=4)
    slow, fast = predict(p)[1], predict(p, LinkRates(ib_gbps=100.0))[1]
    assert fast.phases["pause_grads"].seconds == slow.phases["pause_grads"].seconds
    assert fast.phases["update_weights"].seconds < slow.phases["update_weights"].seconds
    ib = [t for t in slow.phases["update_weights"].terms if t.link is Link.IB]
    saved = sum(t.bytes / (50.0 * 1e9) - t.bytes / (100.0 * 1e9) for t in ib)
    gain = slow.phases["update_weights"].seconds - fast.phases["update_weights"].seconds
    assert abs(gain - saved) <= 1e-12 * slow.phases["update_weights"].seconds


def test_rates_name_each_bad_value() -> None:
    assert LinkRates(nvlink_gbps=0, ib_gbps=-1).problems() == [
        "the NVLink rate must be a positive GB/s, got 0",
        "the InfiniBand rate must be a positive GB/s, got -1",
    ]
