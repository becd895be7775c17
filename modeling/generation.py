"""Generation glue: what `GenerationMixin` needs to drive a multimodal M-RoPE model.

- Positions: 4 rows (text row for the mask + t, h, w) for the whole prompt, recomputed on every
  call; the generic loop slices the uncached part and appends last + 1 per generated (text) token.
- Continuing a cache (multi-turn chat): pass the processor output for the whole conversation with
  the `cache` an earlier generate returned. Only the images and videos whose placeholders are not
  cached yet are encoded, and their positions continue from the cached prefix. Passing only the new
  media works too; their positions then start from the delta stored on the cache.
- Left padding is required for batches; right padding raises instead of generating garbage.
- Nothing is stored on the module between calls; per-conversation state lives on the cache.
"""

import torch
from transformers.generation import GenerationMixin

from ..configuration import num_visual_tokens
from .positions import token_types_from_ids

# Attribute set on a generation cache: per-row offset between M-RoPE and text positions at the last
# cached token, so that a continuation given only new media (or no positions) can place its tokens.
ROPE_DELTAS_ATTR = "vlmkit_rope_deltas"

MEDIA = (  # modality, pixel kwarg, grid kwarg, mm_token_type value
    ("image", "pixel_values", "image_grid_thw", 1),
    ("video", "pixel_values_videos", "video_grid_thw", 2),
)


def cached_length(model_kwargs: dict) -> int:
    cache = model_kwargs.get("cache")
    return cache.get_seq_length() if cache is not None else 0


def shift_by_cached_deltas(text: torch.Tensor, cache) -> torch.Tensor:
    """(B, S) text positions plus the rope delta stored on `cache` (none stored or no cache: 0): the
    M-RoPE position of text tokens that follow the cached prefix."""
    deltas = getattr(cache, ROPE_DELTAS_ATTR, None) if cache is not None else None
    if deltas is None:
        return text
    deltas = deltas.to(text.device)
    return text + deltas.repeat_interleave(text.shape[0] // deltas.shape[0], dim=0)


class VLMKitGenerationMixin(GenerationMixin):
    """GenerationMixin with the multimodal overrides vlmkit needs (see the module docstring)."""

    def _media_split(self, types: torch.Tensor, grids: torch.Tensor, kind: int, past: int,
                     name: str) -> tuple[list[int], bool]:
        """Indices of the media items whose placeholders are NOT in the cached prefix, and whether the
        given grids cover the whole conversation (True) or only the new part (False)."""
        tokens = [num_visual_tokens(g, self.config) for g in grids.tolist()]
        per_row_total = (types == kind).sum(-1).tolist()
        per_row_cached = (types[:, :past] == kind).sum(-1).tolist()
        if sum(tokens) == sum(per_row_total):
            covers_all = True
        elif sum(tokens) == sum(per_row_total) - sum(per_row_cached):
            return list(range(len(tokens))), False
        else:
            raise ValueError(
                f"the {len(tokens)} {name}(s) given describe {sum(tokens)} {name} tokens, but the prompt holds "
                f"{sum(per_row_total)} {name} placeholder tokens, {sum(per_row_cached)} of them already cached; "
                f"pass every {name} of the conversation or only the new ones"
            )
        keep, item = [], 0
        for row, (total, cached) in enumerate(zip(per_row_total, per_row_cached)):
            seen = 0
            while seen < total:
                if seen >= cached:
                    keep.append(item)
                elif seen + tokens[item] > cached:
                    raise ValueError(
                        f"row {row}: the cache ends inside {name} #{item}'s placeholders ({cached} of its row's "
                        f"{name} tokens are cached); continue from a cache that ends on a text token"
                    )
                seen += tokens[item]
                item += 1
        return keep, covers_all

    @staticmethod
    def _select_items(pixels: torch.Tensor, grids: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel rows and grids of the kept items (pixel rows are packed item after item)."""
        chunks = pixels.split(grids.prod(-1).tolist())
        return torch.cat([chunks[i] for i in keep]) if keep else pixels[:0], grids[keep]

    def _token_types(self, model_kwargs: dict, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        types = model_kwargs.get("mm_token_type_ids")
        if types is None and input_ids is not None:
            types = token_types_from_ids(input_ids, self.config.image_token_id, self.config.video_token_id)
        return types

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        text = super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
        input_ids = model_kwargs.get("input_ids")
        if input_ids is None or input_ids.shape[1] == 0:
            input_ids = inputs_tensor
        is_ids = input_ids.ndim == 2 and not torch.is_floating_point(input_ids)
        batch = inputs_tensor.shape[0]
        text = text.expand(batch, -1)
        mask = model_kwargs.get("attention_mask")
        if batch > 1 and mask is not None and mask.ndim == 2 and bool((mask[:, -1] == 0).any()):
            rows = (mask[:, -1] == 0).nonzero().flatten().tolist()
            raise ValueError(
                f"batch rows {rows} are right-padded (their last token is padding); batched generation needs "
                "left padding: VLMKitProcessor pads on the left by default, or pass padding_side='left'"
            )
        types = self._token_types(model_kwargs, input_ids if is_ids else None)
        grids = {name: model_kwargs.get(grid) for name, _, grid, _ in MEDIA}
        past = cached_length(model_kwargs)
        shifted = shift_by_cached_deltas(text, model_kwargs.get("cache"))
        if types is None or all(g is None for g in grids.values()):
            return torch.cat([text[None], shifted[None].expand(3, -1, -1)])

        covers_all = True
        for name, _, _, kind in MEDIA:
            if grids[name] is not None and past > 0:
                _, full = self._media_split(types, grids[name], kind, past, name)
                covers_all &= full
        if covers_all:  # the whole conversation is described: compute it from scratch
            mrope, _ = self.model.mrope_position_ids(types, grids["image"], grids["video"], mask)
            return torch.cat([text[None], mrope.to(text.device)])
        # only the new media are given: lay out the uncached tokens after the cached prefix
        new_mask = mask[:, past:] if mask is not None else None
        mrope, _ = self.model.mrope_position_ids(types[:, past:], grids["image"], grids["video"], new_mask)
        # the segment's positions start at 0; shift them to the M-RoPE position of the first new token
        start = shifted[:, past:past + 1]  # (B, 1)
        mrope = mrope.to(text.device) + start[None]
        if new_mask is not None:
            mrope = mrope.masked_fill(new_mask[None] == 0, 0)
        prefix = shifted[:, :past][None].expand(3, -1, -1)
        return torch.cat([text[None], torch.cat([prefix, mrope], dim=-1)])

    def _maybe_prepare_encoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, model_input_name, generation_config):
        """When continuing a cache, drop the media whose placeholders are already cached before the
        vision tower runs, so only new images and videos are encoded."""
        past = cached_length(model_kwargs)
        if past > 0:
            input_ids = inputs_tensor if model_input_name == "input_ids" else model_kwargs.get("input_ids")
            types = self._token_types(model_kwargs, input_ids)
            for name, pixel_key, grid_key, kind in MEDIA:
                pixels, grids = model_kwargs.get(pixel_key), model_kwargs.get(grid_key)
                if pixels is None or grids is None or types is None:
                    continue
                keep, covers_all = self._media_split(types, grids, kind, past, name)
                if covers_all:
                    model_kwargs[pixel_key], model_kwargs[grid_key] = self._select_items(pixels, grids, keep)
                if not keep:
                    model_kwargs.pop(pixel_key)
                    model_kwargs.pop(grid_key)
        return super()._maybe_prepare_encoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, model_input_name, generation_config
        )
