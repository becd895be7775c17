"""The three trainable components of a vlmkit model, located by module, whatever wraps the model.

- "vision": the vision tower (`model.visual.*`: patch embedding, position table, blocks) without the connector;
- "connector": the connector and its DeepStack instances (`model.visual.merger`, `model.visual.deepstack_merger_list`),
  for every connector type;
- "llm": the language model (`model.language_model.*`) and the LM head.

The prefixes are found from the modules themselves (the first `VLMKitVisionModel` and `VLMKitTextModel`
inside the model), so they hold for the bare model, a `PeftModel` (`base_model.model.` in front) and a
DDP-wrapped model (`module.` in front).
"""

from torch import nn

from ..modeling import VLMKitTextModel, VLMKitVisionModel

COMPONENTS = ("vision", "connector", "llm")
CONNECTOR_ATTRIBUTES = ("merger", "deepstack_merger_list")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def component_prefixes(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{component: module-name prefixes} inside `model`; a component the model lacks gets ()."""
    vision = text = None
    for name, module in model.named_modules():
        if vision is None and isinstance(module, VLMKitVisionModel):
            vision = name
        elif text is None and isinstance(module, VLMKitTextModel):
            text = name
    if vision is None and text is None:
        raise ValueError(f"{type(model).__name__} holds no vlmkit vision tower or language model")
    return {
        "vision": (vision,) if vision is not None else (),
        "connector": tuple(_join(vision, attr) for attr in CONNECTOR_ATTRIBUTES) if vision is not None else (),
        "llm": (text,) if text is not None else (),
    }


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def component_of(name: str, prefixes: dict[str, tuple[str, ...]]) -> str | None:
    """The component a module or parameter name belongs to (connector before the vision tower that holds
    it), or None (the LM head and anything else outside both towers)."""
    for component in ("connector", "vision", "llm"):
        if any(_under(name, prefix) for prefix in prefixes[component]):
            return component
    return None


def connector_module_names(model: nn.Module) -> list[str]:
    """Names of the connector modules (the main one, then one per DeepStack level), for example for peft's
    `modules_to_save` when the connector trains in full beside LoRA adapters elsewhere."""
    prefixes = component_prefixes(model)["connector"]
    if not prefixes:
        return []
    main, stack = prefixes
    modules = dict(model.named_modules())
    levels = len(modules[stack]) if stack in modules else 0
    return [main] + [_join(stack, str(level)) for level in range(levels)]
