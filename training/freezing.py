"""Per-component freezing and staged unfreezing during `Trainer` runs.

`set_trainable(model, components)` trains the named components ("vision", "connector", "llm") and
freezes the rest. A component that holds adapter weights (peft LoRA layers, or the trainable copies
peft keeps for `modules_to_save`) trains only those; one without adapters trains all its weights.
peft's frozen originals (`base_layer`, `original_module`) never train.

`StagedTrainingCallback` switches the trained components at given optimizer steps, the way LLaVA and
Qwen-VL recipes train: the connector alone first, then the connector with the LLM's LoRA, and so on.
Trainer builds its optimizer from the parameters that require grad when training starts, so the
callback makes every parameter any stage trains trainable before that (on Trainer's init), then
freezes down to the current stage; a frozen parameter has no gradient and the optimizer skips it.
Under DDP, pass `ddp_find_unused_parameters=True` with stages: DDP registers parameters once, and a
stage's frozen ones then produce no gradient.
"""

from collections.abc import Iterable, Sequence

from torch import nn
from transformers import TrainerCallback
from transformers.utils import logging

from .components import COMPONENTS, component_of, component_prefixes

logger = logging.get_logger(__name__)

ADAPTER_MARKERS = (".lora_", ".modules_to_save.")
FROZEN_BASE_MARKERS = (".original_module.",)


def _check_components(components: Iterable[str]) -> tuple[str, ...]:
    components = tuple(components) if not isinstance(components, str) else (components,)
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown component(s) {unknown}; choose from {COMPONENTS}")
    return components


def parameter_components(model: nn.Module) -> dict[str, str | None]:
    """{parameter name: component}; the LM head counts as "llm", anything outside the towers as None."""
    prefixes = component_prefixes(model)
    out = {}
    for name, _ in model.named_parameters():
        component = component_of(name, prefixes)
        if component is None and (name.startswith("lm_head.") or ".lm_head." in name):
            component = "llm"
        out[name] = component
    return out


def _is_adapter(name: str) -> bool:
    return any(marker in f".{name}" for marker in ADAPTER_MARKERS)


def trainable_names(model: nn.Module, components: Iterable[str]) -> list[str]:
    """Names of the parameters `set_trainable(model, components)` makes trainable."""
    components = _check_components(components)
    owners = parameter_components(model)
    with_adapters = {owners[name] for name in owners if _is_adapter(name)}
    names = []
    for name, component in owners.items():
        if component not in components:
            continue
        if component in with_adapters:
            if _is_adapter(name):
                names.append(name)
        elif not any(marker in f".{name}" for marker in FROZEN_BASE_MARKERS):
            names.append(name)
    return names


def set_trainable(model: nn.Module, components: Iterable[str]) -> dict[str, int]:
    """Train `components`, freeze everything else; returns the number of trainable weights per component."""
    train = set(trainable_names(model, components))
    owners = parameter_components(model)
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, param in model.named_parameters():
        param.requires_grad_(name in train)
        if name in train:
            counts[owners[name]] += param.numel()
    return counts


class StagedTrainingCallback(TrainerCallback):
    """Train different components in successive stages of one `Trainer` run.

    Args:
        stages: `(first_step, components)` pairs in increasing step order, the first at step 0; stage k
            trains its components from optimizer step `first_step` (steps done) until the next stage.
            Example: `[(0, ["connector"]), (200, ["connector", "llm"])]`.

    Pass it to `Trainer(callbacks=[...])`, or call `prepare(model)` before Trainer builds its optimizer.
    """

    def __init__(self, stages: Sequence[tuple[int, Iterable[str]]]):
        stages = [(int(step), _check_components(components)) for step, components in stages]
        if not stages or stages[0][0] != 0:
            raise ValueError(f"the first stage must start at step 0, got stages {stages}")
        steps = [step for step, _ in stages]
        if steps != sorted(set(steps)):
            raise ValueError(f"stage start steps must increase strictly, got {steps}")
        self.stages = stages
        self.current: tuple[str, ...] | None = None

    def components_at(self, step: int) -> tuple[str, ...]:
        return [components for first, components in self.stages if first <= step][-1]

    def prepare(self, model: nn.Module) -> None:
        """Make every parameter that any stage trains trainable, so the optimizer includes it."""
        set_trainable(model, self._all_components())
        self.current = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.prepare(model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if optimizer is not None:
            in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
            staged = set(trainable_names(model, self._all_components()))
            missing = [name for name, p in model.named_parameters() if name in staged and id(p) not in in_optimizer]
            if missing:
                raise ValueError(
                    f"{len(missing)} parameter(s) a stage trains are not in the optimizer (first: {missing[0]}); "
                    "pass the callback to Trainer(callbacks=[...]) or call callback.prepare(model) before training"
                )
        self._apply(model, state.global_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._apply(model, state.global_step)

    def _all_components(self) -> set[str]:
        return {c for _, components in self.stages for c in components}

    def _apply(self, model: nn.Module, step: int) -> None:
        components = self.components_at(step)
        if components == self.current:
            return
        counts = set_trainable(model, components)
        self.current = components
        logger.info(f"step {step}: training {', '.join(components)} ({counts} trainable weights per component)")
