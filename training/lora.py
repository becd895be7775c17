"""LoRA targets by scope, so that suffixes shared by both towers never adapt the wrong one.

`gate_proj`, `up_proj`, `down_proj`, `q_proj`, ... name Linear layers of the language model and of
some connectors (the Perceiver resampler), and a plain suffix list given to peft matches all of them.
`lora_target_modules(model, scope)` instead returns one regular expression that peft matches against
full module names (`re.fullmatch`): exactly the `nn.Linear` layers of the scope's components. Conv3d
(the patch embedding), Embeddings (tokens, the vision position table) and norms are never targets,
and neither is the LM head.
"""

import re
from collections.abc import Iterable

from torch import nn

from .components import COMPONENTS, component_of, component_prefixes

LORA_SCOPES = ("llm", "vision", "connector", "all")


def _pattern(name: str) -> str:
    """A module name as a regex with its layer indices generalised: blocks.3.attn.qkv -> blocks\\.\\d+\\.attn\\.qkv."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


def _scope_components(scope: str | Iterable[str]) -> set[str]:
    scopes = (scope,) if isinstance(scope, str) else tuple(scope)
    unknown = [s for s in scopes if s not in LORA_SCOPES]
    if unknown or not scopes:
        raise ValueError(f"scope must be one of {LORA_SCOPES} (or several of them), got {scope!r}")
    return set(COMPONENTS) if "all" in scopes else set(scopes)


def lora_target_names(model: nn.Module, scope: str | Iterable[str] = "llm") -> list[str]:
    """Names of the Linear layers LoRA adapts under `scope`: "llm", "vision", "connector", "all", or
    several of them (("llm", "vision"))."""
    components = _scope_components(scope)
    prefixes = component_prefixes(model)
    names = []
    for name, module in model.named_modules():
        if any(part.startswith("lora_") for part in name.split(".")):
            raise ValueError(
                f"{type(model).__name__} already holds LoRA layers ({name}); choose targets on the base model, "
                "before get_peft_model"
            )
        if isinstance(module, nn.Linear) and component_of(name, prefixes) in components:
            names.append(name)
    return names


def lora_target_modules(model: nn.Module, scope: str | Iterable[str] = "llm") -> str:
    """`target_modules` for peft's `LoraConfig`: a regex matching exactly the Linear layers of `scope`.

    Layer indices are generalised (`\\d+`) when that still matches exactly the same modules, so the saved
    adapter config stays short; otherwise the regex lists every name.
    """
    names = lora_target_names(model, scope)
    if not names:
        raise ValueError(f"{type(model).__name__} has no Linear layer in scope {scope!r}")
    regex = "|".join(sorted({_pattern(name) for name in names}))
    every_module = [name for name, _ in model.named_modules()]
    if {name for name in every_module if re.fullmatch(regex, name)} != set(names):
        regex = "|".join(re.escape(name) for name in names)
    return f"^(?:{regex})$"
