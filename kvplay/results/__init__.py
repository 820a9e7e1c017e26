"""Results: what every command returns, the UI shows and the JSON contract holds, and the one registry of kinds.

One module per feature (compare, memory, quality, capacity, inside, tradeoffs). Each result class declares its
`kind` (the JSON's "kind" field) and its `title` (the report's heading) as class attributes, and RESULTS
lists them all:

    to_dict(result)           # {"kind": "compare", ...fields}: the documented JSON contract
    from_dict(data)           # the result again, nested dataclasses rebuilt from the field types
    RESULTS["needle"].title   # "Inside: find the number"

Plain numbers and strings only (no tensors), so results serialise to JSON and plots never need a live model.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import types
import typing

from kvplay.results.advise import AdviseResult, Caveat, DeploySetting, Measured
from kvplay.results.capacity import CapacityResult, CapacityRow
from kvplay.results.compare import MIN_TIMED_STEPS, CacheLabel, CacheRun, CompareResult, speed_reason, timed
from kvplay.results.environment import Environment
from kvplay.results.inside import (
    AttentionShift,
    ErrorMaps,
    HeadErrors,
    HeadStats,
    KeptCache,
    KeptResult,
    LayerStats,
    NeedleCache,
    NeedleResult,
    OutliersResult,
    SchemeRisk,
)
from kvplay.results.memory import MemoryResult, SeriesResult, ThroughputResult
from kvplay.results.profile import ModelProfile
from kvplay.results.quality import ModelRow, ModelsResult, PplResult, PplRun
from kvplay.results.tasks import TASK_LABELS, TaskCache, TaskCell, TasksResult
from kvplay.results.tradeoffs import (
    METRICS,
    DriftCache,
    DriftResult,
    ParetoPoint,
    ParetoResult,
    WindowCache,
    WindowSweepResult,
    frontier,
)

RESULTS: dict[str, type] = {cls.kind: cls for cls in (
    CompareResult, MemoryResult, ThroughputResult, PplResult, ModelsResult, CapacityResult,
    OutliersResult, NeedleResult, ErrorMaps, AttentionShift, KeptResult,
    ParetoResult, WindowSweepResult, DriftResult, TasksResult, AdviseResult, ModelProfile)}
INSIDE = (OutliersResult, NeedleResult, ErrorMaps, AttentionShift, KeptResult)   # the Inside tab's kinds
TRADEOFFS = (ParetoResult, WindowSweepResult, DriftResult, TasksResult)  # the Trade-offs tab's kinds

__all__ = ["ModelProfile", "AdviseResult", "Caveat", "DeploySetting", "Measured",
           "TASK_LABELS", "TaskCache", "TaskCell", "TasksResult", "KeptCache", "KeptResult",
           "METRICS", "RESULTS", "INSIDE", "TRADEOFFS", "to_dict", "to_json", "to_csv", "from_dict", "is_result",
           "MIN_TIMED_STEPS", "timed", "speed_reason",
           "CacheLabel", "frontier", "Environment", "CacheRun", "CompareResult", "SeriesResult",
           "MemoryResult", "ThroughputResult", "PplRun", "PplResult",
           "ModelRow", "ModelsResult", "CapacityRow", "CapacityResult", "HeadStats",
           "LayerStats", "SchemeRisk", "OutliersResult", "NeedleCache", "NeedleResult", "HeadErrors", "ErrorMaps",
           "AttentionShift", "ParetoPoint", "ParetoResult", "WindowCache", "WindowSweepResult", "DriftCache",
           "DriftResult"]


def is_result(obj, kinds: tuple[type, ...] = tuple(RESULTS.values())) -> bool:
    return isinstance(obj, kinds)


def to_dict(result) -> dict:
    """The JSON contract: "kind" first, then the result's fields."""
    return {"kind": result.kind, **dataclasses.asdict(result)}


def to_json(result, path=None) -> str:
    text = json.dumps(to_dict(result), indent=1)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def to_csv(result, path=None) -> str:
    rows = result.summary_rows()
    buf = io.StringIO()
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(buf, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    if path:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(buf.getvalue())
    return buf.getvalue()


def _value(hint, value):
    """value read back as `hint` says: a dataclass (or a list of them) rebuilt, anything else as stored."""
    if isinstance(value, dict) and dataclasses.is_dataclass(hint):
        return _build(hint, value)
    args = typing.get_args(hint)
    if isinstance(value, list) and typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return [_build(args[0], v) for v in value]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):          # `Environment | None`
        return next((_value(a, value) for a in args if a is not type(None) and dataclasses.is_dataclass(a)), value)
    return value


def _build(cls, data: dict):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    return cls(**{k: _value(hints[k], v) for k, v in data.items()})


def from_dict(data: dict):
    """Rebuild a result from its JSON form (`report --inputs`, the plots, the recordings): KeyError for an
    unknown kind, TypeError for fields the kind does not have."""
    return _build(RESULTS[data["kind"]], {k: v for k, v in data.items() if k != "kind"})
