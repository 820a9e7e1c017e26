"""Cache methods, one module each, and the registry that maps scheme names to them.

    from kvplay.cache.methods import METHODS, SCHEMES
    SCHEMES["kvplay-int4"].method.build(spec, model)

The built-in methods (dynamic, quanto, hqq, hf_fp8, kvplay, llamacpp, vllm_fp8: the order of
the UI's presets and the docs tables) register themselves when kvplay.cache is imported, which
any import of this package does first. A method's `family` says where people meet it
("transformers", "llama.cpp / Ollama / LM Studio", "vLLM", ...) for the UI to group by.
A new method is one module that subclasses CacheMethod and calls
register(); see CONTRIBUTING.md.
"""
from __future__ import annotations

from kvplay.cache.methods.base import (
           METHODS,
           SCHEMES,
           CacheBytes,
           CacheMethod,
           NoOptions,
           OptionSpec,
           Scheme,
           all_option_names,
           method_for_layer,
           option,
           refuse_sliding_layers,
           register,
           require_group_divides,
           tensor_nbytes,
           unregister,
)

__all__ = ["METHODS", "SCHEMES", "CacheBytes", "CacheMethod", "NoOptions", "OptionSpec", "Scheme", "option",
           "register", "unregister", "method_for_layer", "all_option_names", "refuse_sliding_layers",
           "require_group_divides", "tensor_nbytes"]
