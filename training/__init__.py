"""vlmkit.training: fine-tuning helpers for `Trainer` + peft.

- `VLMKitDataCollator`: chat rows with images and videos -> batches whose labels learn only the
  assistant turns (content and <|im_end|>); no truncation that could cut a vision span; padded or
  packed (padding-free) batches.
- `lora_target_modules(model, scope)`: a `LoraConfig(target_modules=...)` regex for scope "llm",
  "vision", "connector" or "all", never matching the other tower, a Conv3d, an Embedding or a norm.
- `set_trainable(model, components)` and `StagedTrainingCallback`: per-component freezing, and
  stages that switch the trained components during one run.
- `per_sample_loss`, `per_answer_loss`: `compute_loss_func`s that weight samples, or each sample's
  answers (assistant turns), equally instead of tokens; `LOSS_FUNCTIONS` names them (and "token").
- `VLMKitTrainer`: `Trainer` that keeps those per-micro-batch means right under gradient accumulation
  and DDP, where a plain `Trainer` scales them by the accumulation steps and the processes.
"""

from .collator import IGNORE_INDEX, VLMKitDataCollator
from .components import COMPONENTS, component_of, component_prefixes, connector_module_names
from .freezing import StagedTrainingCallback, parameter_components, set_trainable, trainable_names
from .lora import LORA_SCOPES, lora_target_modules, lora_target_names
from .losses import LOSS_FUNCTIONS, per_answer_loss, per_sample_loss
from .trainer import VLMKitTrainer

__all__ = [
    "COMPONENTS",
    "IGNORE_INDEX",
    "LORA_SCOPES",
    "LOSS_FUNCTIONS",
    "StagedTrainingCallback",
    "VLMKitDataCollator",
    "VLMKitTrainer",
    "component_of",
    "component_prefixes",
    "connector_module_names",
    "lora_target_modules",
    "lora_target_names",
    "parameter_components",
    "per_answer_loss",
    "per_sample_loss",
    "set_trainable",
    "trainable_names",
]
