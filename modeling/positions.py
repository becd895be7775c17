"""3D (t, h, w) position ids for the multimodal sequence (interleaved M-RoPE).

Computed per row from the attention mask, so left padding never shifts a row's positions:
padded slots get 0 and real tokens start at 0. Text runs advance all three rows together. A visual
block placed at offset `p` is laid out by the connector's M-RoPE layout (`geometry.mrope_layout`):

- "grid" (merger, mlp; optional for query connectors): t = p, h = p + row, w = p + col over its LLM
  grid (raster order), and the next token continues at p + max(gh, gw) (Qwen3-VL's rule, not the
  token count).
- "sequence" (Q-Former, resampler): the k-th token gets t = h = w = p + k, like text, and the next
  token continues at p + gh * gw (Qwen2.5-Omni's rule for audio tokens, which have no grid).

Video grids are split per temporal slice: each slice is its own block, its time carried by the
`<t seconds>` text before it.

Nothing here is stored on a module: the per-row offset between these positions and the plain text
positions (the "rope delta") is returned to the caller.
"""

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types_from_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """mm_token_type_ids as the processor makes them: 0 text, 1 image placeholder, 2 video placeholder."""
    types = torch.zeros_like(input_ids)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def split_video_grids(llm_grids: torch.Tensor | None) -> torch.Tensor | None:
    """(videos, 3) LLM grids -> (sum t, 3) single-slice grids."""
    if llm_grids is None:
        return None
    slices = torch.repeat_interleave(llm_grids, llm_grids[:, 0], dim=0)
    slices[:, 0] = 1
    return slices


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs of equal token type as (type, start, end)."""
    runs, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


def _grid_block(start: int, gh: int, gw: int) -> tuple[torch.Tensor, int]:
    rows = torch.arange(gh).repeat_interleave(gw)
    cols = torch.arange(gw).repeat(gh)
    return torch.stack([torch.zeros_like(rows), rows, cols]) + start, start + max(gh, gw)  # (3, gh*gw)


def _sequence_block(start: int, gh: int, gw: int) -> tuple[torch.Tensor, int]:
    return torch.arange(gh * gw).expand(3, -1) + start, start + gh * gw  # (3, gh*gw)


# layout -> (block start, LLM grid) -> (positions of the block's tokens, where the next token starts)
BLOCK_LAYOUTS = {"grid": _grid_block, "sequence": _sequence_block}


def multimodal_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_llm_grids: torch.Tensor | None,
    video_llm_grids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    layout: str = "grid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (3, B, S) and rope deltas (B, 1) = max position + 1 - number of real tokens.

    `image_llm_grids` / `video_llm_grids` are (items, 3) LLM-token grids, in the order their
    placeholders appear across the batch (row-major over the batch, then the sequence). `layout`
    is the connector's M-RoPE layout, "grid" or "sequence".
    """
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"M-RoPE layout {layout!r} is not one of {sorted(BLOCK_LAYOUTS)}")
    place_block = BLOCK_LAYOUTS[layout]
    batch, seq = mm_token_type_ids.shape
    device = mm_token_type_ids.device
    positions = torch.zeros(3, batch, seq, dtype=torch.long)
    deltas = torch.zeros(batch, 1, dtype=torch.long)
    queues = {
        IMAGE: (image_llm_grids.tolist() if image_llm_grids is not None else [], "image"),
        VIDEO: (split_video_grids(video_llm_grids).tolist() if video_llm_grids is not None else [], "video"),
    }
    cursor = {IMAGE: 0, VIDEO: 0}
    types_cpu = mm_token_type_ids.cpu()
    keep_cpu = attention_mask.bool().cpu() if attention_mask is not None else torch.ones(batch, seq, dtype=torch.bool)

    for b in range(batch):
        row_types = types_cpu[b][keep_cpu[b]].tolist()
        pieces, pos = [], 0
        for kind, start, end in _runs(row_types):
            if kind == TEXT:
                pieces.append(torch.arange(end - start).expand(3, -1) + pos)
                pos += end - start
                continue
            grids, name = queues[kind]
            remaining = end - start
            while remaining > 0:  # adjacent blocks without a separator still get their own grids
                if cursor[kind] >= len(grids):
                    raise ValueError(
                        f"sample {b}: more {name} placeholder tokens than the {len(grids)} {name} grid(s) "
                        f"passed in {name}_grid_thw describe"
                    )
                _, gh, gw = grids[cursor[kind]]
                if gh * gw > remaining:
                    raise ValueError(
                        f"sample {b}: a run of {end - start} {name} placeholder tokens does not match the "
                        f"{name} grids; {name} #{cursor[kind]} needs {gh * gw} tokens"
                    )
                cursor[kind] += 1
                block, pos = place_block(pos, gh, gw)
                pieces.append(block)
                remaining -= gh * gw
        row = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
        positions[:, b, keep_cpu[b]] = row
        deltas[b, 0] = (int(row.max()) + 1 - row.shape[1]) if row.numel() else 0

    for kind, (grids, name) in queues.items():
        if cursor[kind] != len(grids):
            raise ValueError(
                f"{len(grids)} {name} grid(s) given but the placeholders in input_ids cover only {cursor[kind]}"
            )
    return positions.to(device), deltas.to(device)


def text_positions(attention_mask: torch.Tensor | None, batch: int, seq: int, past: int, device) -> torch.Tensor:
    """(B, S) sequential positions of the last `seq` tokens: from the 2D mask (pads 0) or arange."""
    if attention_mask is not None and attention_mask.ndim == 2:
        pos = attention_mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(attention_mask == 0, 0)
        return pos[:, -seq:].to(device)
    return (torch.arange(seq, device=device) + past).expand(batch, -1)
