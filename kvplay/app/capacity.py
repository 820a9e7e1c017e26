"""Capacity's command: the longest context and largest batch each cache fits on a GPU, from the byte formulas
alone (kvplay.lab.capacity; the Memory tab's capacity panel). No model loads."""
from __future__ import annotations

from kvplay.app.checks import check_int, parse_specs
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError
from kvplay.lab.capacity import capacity_for


def capacity(specs, arch, gpu_gib, weight_dtype="float16", context=4096, settings: Settings | None = None):
    """The longest context and largest batch each spec fits on a GPU: formulas only, no model loads."""
    settings = settings or Settings.from_env()
    specs = parse_specs(specs, settings)
    if not isinstance(arch, str):
        raise KvplayError(f"The architecture must be a name such as 'Llama-2-7B', not {type(arch).__name__}.")
    try:
        gpu_gib = float(gpu_gib)
    except (TypeError, ValueError, OverflowError):
        raise KvplayError("GPU memory must be a positive number of GiB.") from None
    if not isinstance(weight_dtype, str):
        raise KvplayError(f"Unknown weight dtype {weight_dtype!r:.40}.")
    context = check_int(context, "Context", 1, 10_000_000)
    return capacity_for(specs, arch, gpu_gib, weight_dtype, context)
