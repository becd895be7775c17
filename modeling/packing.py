"""Packed (padding-free) sequences: several samples in one row, told apart by their text positions.

A packed row carries no attention mask; its text position row restarts at 0 where each sample begins
(`[0, 1, 2, 0, 1, 0, 1, 2, 3]` holds three samples). From that row alone:

- the decoder's mask: transformers' `create_causal_mask` reads a text row that does not increase by
  one as segment boundaries and builds a block-diagonal (causal within a segment) mask under eager
  and sdpa, provided no cache is passed; flash kernels get the segments' `cu_seq_lens` (varlen);
- M-RoPE: each segment gets the (t, h, w) positions it would get alone, computed by
  `positions.multimodal_position_ids` on the segment with the images and videos it holds.

Shapes: B rows, S tokens per row.
"""

import torch

from .positions import IMAGE, VIDEO, multimodal_position_ids


def segment_starts(text_positions: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: True where a segment begins (the first token, or a position that is not previous + 1)."""
    starts = torch.ones_like(text_positions, dtype=torch.bool)
    starts[:, 1:] = text_positions[:, 1:] != text_positions[:, :-1] + 1
    return starts


def is_packed(text_positions: torch.Tensor) -> bool:
    """Whether any row holds more than one segment."""
    return text_positions.shape[-1] > 1 and bool(segment_starts(text_positions)[:, 1:].any())


def segment_lengths(text_positions: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of its segments in order."""
    lengths = []
    for row in segment_starts(text_positions).cpu():
        starts = row.nonzero().flatten().tolist() + [row.shape[0]]
        lengths.append([end - start for start, end in zip(starts[:-1], starts[1:])])
    return lengths


def _take_grids(queue: list[list[int]], cursor: int, tokens: int, name: str, where: str):
    """The (t, gh, gw) grids at queue[cursor:] whose t * gh * gw add up to `tokens` (a segment's placeholders)."""
    taken = []
    while tokens > 0:
        if cursor >= len(queue):
            raise ValueError(f"{where}: {tokens} {name} placeholder tokens are left but no {name} grid remains")
        t, gh, gw = queue[cursor]
        count = t * gh * gw
        if count > tokens:
            raise ValueError(
                f"{where}: {name} #{cursor} needs {count} tokens but the segment holds only {tokens} more; "
                f"a {name} never spans two packed samples"
            )
        taken.append(queue[cursor])
        tokens -= count
        cursor += 1
    return taken, cursor


def packed_position_ids(
    text_positions: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_llm_grids: torch.Tensor | None,
    video_llm_grids: torch.Tensor | None,
    layout: str = "grid",
) -> torch.Tensor:
    """(4, B, S) positions of packed rows: row 0 is `text_positions` (the mask builder reads the segment
    boundaries from it), rows 1-3 the M-RoPE positions of each segment as if it stood alone, offset by
    the segment's first text position.

    `image_llm_grids` / `video_llm_grids` are (items, 3) LLM token grids in placeholder order over the
    batch, as for `multimodal_position_ids`; each segment takes the items its placeholders cover.
    """
    batch, seq = text_positions.shape
    types_cpu = mm_token_type_ids.cpu()
    text_cpu = text_positions.cpu().long()
    mrope = torch.zeros(3, batch, seq, dtype=torch.long)
    queues = {
        IMAGE: (image_llm_grids.tolist() if image_llm_grids is not None else [], "image"),
        VIDEO: (video_llm_grids.tolist() if video_llm_grids is not None else [], "video"),
    }
    cursor = {IMAGE: 0, VIDEO: 0}
    for b, lengths in enumerate(segment_lengths(text_cpu)):
        start = 0
        for index, length in enumerate(lengths):
            end = start + length
            types = types_cpu[b : b + 1, start:end]  # (1, L)
            grids = {}
            for kind, (queue, name) in queues.items():
                where = f"row {b}, packed segment {index} (tokens {start}..{end - 1})"
                taken, cursor[kind] = _take_grids(queue, cursor[kind], int((types == kind).sum()), name, where)
                grids[kind] = torch.tensor(taken, dtype=torch.long) if taken else None
            positions, _ = multimodal_position_ids(types, grids[IMAGE], grids[VIDEO], layout=layout)
            mrope[:, b, start:end] = positions[:, 0] + text_cpu[b, start]
            start = end
    for kind, (queue, name) in queues.items():
        if cursor[kind] != len(queue):
            raise ValueError(f"{len(queue)} {name} grid(s) given but the packed placeholders cover only {cursor[kind]}")
    return torch.cat([text_positions[None].long(), mrope.to(text_positions.device)], dim=0)


def flash_varlen_kwargs(text_positions: torch.Tensor) -> dict:
    """`cu_seq_lens_q/k` and `max_length_q/k` of the segments of all rows, flattened row after row,
    as transformers' flash attention takes them for varlen calls (any batch size, unlike inferring
    them from position ids, which only handles one row)."""
    starts = segment_starts(text_positions).flatten()
    boundaries = torch.cat([starts.nonzero().flatten(), torch.tensor([starts.numel()], device=starts.device)])
    cu_seq_lens = boundaries.to(torch.int32)
    max_length = int(cu_seq_lens.diff().max())
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max_length,
            "max_length_k": max_length}
