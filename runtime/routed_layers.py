"""Which layers of a model route-fetch their experts, set up as one runtime.routed_experts.RoutedExperts: from a
plan's ``experts`` section (which layers are routed, with which resident experts and fetch slots, and whether and
how deep the next layer's experts are prefetched, which experts the host CPU computes), or from a layer ->
resident experts map (apply_routed_experts, for tests and benchmarks).
"""

from torch import nn

from planner.errors import PlanError
from planner.plan.experts_section import NEXT_LAYER_ROUTER, ROUTED
from runtime.experts_impl import experts_module
from runtime.routed_experts import PREFETCH_GATHER_PROGRAMS, RoutedExperts

def allocate_for_plan(plan, layers: list[nn.Module], backend) -> RoutedExperts | None:
    """The routed experts of a plan's ``experts`` section, allocated (host and device) but not started: the
    loader reads their params into ``host_allocation`` at ``host_items``, then calls ``start``. None where the
    plan routes no layer."""
    routed, fetch_slots = routed_from_plan(plan)
    if not routed:
        return None
    bad = [index for index in routed if not 0 <= index < len(layers)]
    if bad:
        raise PlanError(f"the plan routes layers {bad} but the model has {len(layers)}; regenerate the plan")
    overlap = sorted(set(routed) & set(plan.offload.layers))
    if overlap:
        raise PlanError(f"layers {overlap} are both offloaded whole and routed in the plan; regenerate it")
    modules = {index: experts_module(layers[index], index) for index in routed}
    cpu, cpu_dtype, cpu_threads = cpu_from_plan(plan)
    return RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend,
                         decoder_layers={index: layers[index] for index in routed},
                         prefetch=prefetch_from_plan(plan), prefetch_depth=prefetch_depth_from_plan(plan),
                         cpu=cpu, cpu_dtype=cpu_dtype, cpu_threads=cpu_threads, cpu_take=cpu_take_from_plan(plan))


def prefetch_from_plan(plan) -> bool:
    """Whether the plan's experts section asks for next-layer prefetch (``prefetch: next_layer_router``);
    plans made before it have no such field: no prefetch."""
    return getattr(getattr(plan, "experts", None), "prefetch", None) == NEXT_LAYER_ROUTER


def prefetch_depth_from_plan(plan) -> int | None:
    """The plan's experts.prefetch_depth (ranks of each prediction prefetched); None (all k) in plans made
    before it."""
    depth = getattr(getattr(plan, "experts", None), "prefetch_depth", None)
    return None if depth is None else int(depth)


def cpu_from_plan(plan) -> tuple[dict[int, tuple[int, ...]], str, int | None]:
    """(routed layer -> CPU expert ids, the host copy's dtype, threads) of the plan's experts section: each routed
    layer's ``cpu`` ids and the section's ``cpu`` (dtype, threads). Plans made before CPU experts have neither:
    none, "fp32", None (torch's thread count)."""
    experts = getattr(plan, "experts", None)
    if experts is None:
        return {}, "fp32", None
    cpu = {layer.index: tuple(getattr(layer, "cpu", ()) or ()) for layer in getattr(experts, "layers", ())
           if getattr(layer, "regime", None) == ROUTED and getattr(layer, "cpu", ())}
    section = getattr(experts, "cpu", None)
    threads = getattr(section, "threads", None)
    return cpu, getattr(section, "dtype", None) or "fp32", int(threads) if threads else None


def cpu_take_from_plan(plan) -> dict[int, tuple[float, ...]]:
    """Routed layer -> j(m) of the plan's layers that split each step's misses with the CPU by their count
    (``cpu_take``); none in plans with fixed CPU ids or made before it."""
    experts = getattr(plan, "experts", None)
    return {layer.index: tuple(layer.cpu_take) for layer in getattr(experts, "layers", ())
            if getattr(layer, "regime", None) == ROUTED and getattr(layer, "cpu_take", ())}


def routed_from_plan(plan) -> tuple[dict[int, tuple[int, ...]], int]:
    """(layer -> resident ids, fetch_slots) of the plan's routed layers; empty where the plan has no
    ``experts`` section (dense plans, plans made before it) or routes no layer. Read defensively: the
    planner's dataclasses (planner.plan.schema ExpertsPlan / ExpertLayer) may lack fields in older plans."""
    experts = getattr(plan, "experts", None)
    if experts is None:
        return {}, 0
    routed = {layer.index: tuple(layer.resident) for layer in getattr(experts, "layers", ())
              if getattr(layer, "regime", None) == ROUTED}
    return routed, int(getattr(experts, "fetch_slots", 0) or 0)


def apply_routed_experts(model: nn.Module, routed: dict[int, tuple[int, ...]], fetch_slots: int, backend,
                         stack: str = "model.layers", adopt_host: bool = False, prefetch: bool = False,
                         prefetch_programs: int = PREFETCH_GATHER_PROGRAMS,
                         prefetch_depth: "int | dict[int, int] | None" = None,
                         cpu: dict[int, tuple[int, ...]] | None = None, cpu_dtype: str = "fp32",
                         cpu_threads: int | None = None,
                         cpu_take: dict[int, tuple[float, ...]] | None = None) -> RoutedExperts | None:
    """Route-fetch the experts of the layers ``routed`` names (layer index -> resident expert ids): their
    fused expert params move to page-locked, mapped host memory (resident ones also to the GPU) and their
    forward fetches what each step routes to. Non-expert params are left where they are (the caller puts
    them on the GPU); ``adopt_host``, ``prefetch``, ``prefetch_programs``, ``prefetch_depth``, ``cpu``,
    ``cpu_dtype``, ``cpu_threads``, ``cpu_take``: see RoutedExperts. None when ``routed`` is empty."""
    if not routed:
        return None
    layers = list(model.get_submodule(stack))
    bad = [index for index in routed if not 0 <= index < len(layers)]
    if bad:
        raise PlanError(f"routed layers {bad} are outside the model's {len(layers)} layers")
    modules = {index: experts_module(layers[index], index) for index in routed}
    experts = RoutedExperts(modules=modules, resident=routed, fetch_slots=fetch_slots, backend=backend,
                            adopt_host=adopt_host, decoder_layers={index: layers[index] for index in routed},
                            prefetch=prefetch, prefetch_programs=prefetch_programs, prefetch_depth=prefetch_depth,
                            cpu=cpu, cpu_dtype=cpu_dtype, cpu_threads=cpu_threads, cpu_take=cpu_take)
    try:
        experts.start()
    except BaseException:
        experts.close()
        raise
    return experts
