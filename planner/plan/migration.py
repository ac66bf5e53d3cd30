"""Reading schema 1 plans: the keys added while it was current take their earlier values, and what schema 2
records that schema 1 did not follows from what it did."""



from planner.errors import PlanError
from planner.plan.schema import SCHEMA_VERSION


#: keys schema 1 plans may lack (added while it was current, with these values before them)
_SCHEMA_1_DEFAULTS = {
    "inputs": {"measure": False, "measured_on": None, "cuda_graph": False, "host_memory": None, "concurrency": None,
               "chunk": 2048, "kv_dtype": "auto", "max_tpot_ms": None, "gpu_memory": None},
    "hardware": {"host_memory_bytes": None, "cuda_context_bytes": None},
    "workload": {"cuda_graph": False, "kv_dtype": "bf16"},
    "offload": {"replay_start_copies": 0},
    # schema 1 planned the weights alone: the rest of the GPU is not known
    "memory": {"kv_cache_bytes": None, "activation_bytes": None, "cuda_graph_pool_bytes": 0, "cuda_context_bytes": 0,
               "total_gpu_bytes": None},
    "prediction": {"decode_step_ms": None, "decode_tokens_per_s": None, "prefill_chunk_ms": None},
}


def _schema_1_derived(data: dict) -> dict:
    """Schema 2 fields whose schema 1 value follows from others: section -> key -> value."""
    workload, hardware = data.get("workload"), data.get("hardware")
    if not isinstance(workload, dict) or not isinstance(hardware, dict):
        return {}
    return {"workload": {"concurrency": workload.get("sequences_per_step"),
                         "chunk_tokens": workload.get("tokens_per_step")},
            "memory": {"gpu_memory_bytes": hardware.get("gpu_memory_bytes")}}


def upgraded_from_1(data: dict, origin: str) -> dict:
    """A schema 1 plan in schema 2's terms: keys added during schema 1 take their earlier values, and each layer
    row's selected_bytes is what its copy_ms implies (schema 1 kept only that rounded time)."""
    upgraded = dict(data, schema_version=SCHEMA_VERSION)
    derived = _schema_1_derived(data)
    for name, defaults in _SCHEMA_1_DEFAULTS.items():
        if isinstance(data[name], dict):
            upgraded[name] = {**defaults, **derived.get(name, {}), **data[name]}
    hardware, offload = upgraded["hardware"], upgraded["offload"]
    if not isinstance(data["layers"], list) or not isinstance(hardware, dict) or not isinstance(offload, dict):
        return upgraded  # the strict reader names what is wrong
    try:
        rows = [dict(row, selected_bytes=_selected_bytes_of_1(row, hardware, bool(offload.get("params"))))
                for row in data["layers"]]
    except (TypeError, ValueError, KeyError) as error:
        raise PlanError(f"{origin}: a schema 1 layer row cannot be read ({error}); regenerate the plan") from None
    return dict(upgraded, layers=rows)


def _selected_bytes_of_1(row: dict, hardware: dict, by_params: bool) -> int:
    if row["offloaded_bytes"] or not by_params:
        return row["offloaded_bytes"] or row["bytes"]
    link_ms = row["copy_ms"] - hardware["copy_overhead_us"] / 1e3
    return min(row["bytes"], max(0, round(link_ms * hardware["h2d_bytes_per_s"] / 1e3)))
