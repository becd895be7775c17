"""Per-patch tables derived from `grid_thw`: attention segments, rotary coordinates and the
bilinear taps into the learned position table.

Patches arrive in the processor's order, which is block-major over merge windows: inside each
frame the rows run over (h/m, w/m, m, m), so m*m consecutive patches form one merge unit. Every
per-patch table here uses that order. Videos repeat the per-frame tables t times.
"""

import torch


def check_grid_thw(grid_thw: torch.Tensor, spatial_merge_size: int, name: str = "grid_thw") -> torch.Tensor:
    """Validate a (num_items, 3) grid and return it as a 2D long tensor."""
    if not isinstance(grid_thw, torch.Tensor):
        grid_thw = torch.as_tensor(grid_thw)
    if grid_thw.ndim == 1 and grid_thw.numel() == 3:
        grid_thw = grid_thw[None]
    if grid_thw.ndim != 2 or grid_thw.shape[-1] != 3:
        raise ValueError(f"{name} must have shape (num_items, 3) as (t, h, w), got {tuple(grid_thw.shape)}")
    bad = (grid_thw[:, 1] % spatial_merge_size != 0) | (grid_thw[:, 2] % spatial_merge_size != 0)
    bad |= (grid_thw <= 0).any(-1)
    if bad.any():
        i = int(bad.nonzero()[0])
        t, h, w = grid_thw[i].tolist()
        raise ValueError(
            f"{name}[{i}] = (t={t}, h={h}, w={w}): height and width must be positive multiples of "
            f"spatial_merge_size {spatial_merge_size}"
        )
    return grid_thw.long()


def attention_segments(grid_thw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32, one segment per image and per temporal slice of a video) and max length."""
    seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0


def _block_major(table: torch.Tensor, h: int, w: int, m: int) -> torch.Tensor:
    """(h, w, ...) raster table -> (h*w, ...) in merge-block order (h/m, w/m, m, m)."""
    rest = table.shape[2:]
    table = table.reshape(h // m, m, w // m, m, *rest).transpose(1, 2)  # (h/m, w/m, m, m, ...)
    return table.reshape(h * w, *rest)


def patch_coordinates(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(P, 2) long (row, col) of every patch, for the 2D rotary."""
    coords = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hw = torch.stack([rows, cols], dim=-1)  # (h, w, 2)
        coords.append(_block_major(hw, h, w, spatial_merge_size).repeat(t, 1))
    return torch.cat(coords).to(grid_thw.device)


def raster_order(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(P,) long gather index that lists the packed block-major patches frame by frame in raster order.

    `features[raster_order(grid_thw, m)]` puts patch (row, col) of each frame at row * w + col.
    """
    m, order, offset = spatial_merge_size, [], 0
    for t, h, w in grid_thw.tolist():
        # the block-major indices laid out as (h/m, w/m, m, m), read back in (h/m, m, w/m, m) raster order
        frame = torch.arange(h * w).reshape(h // m, w // m, m, m).permute(0, 2, 1, 3).reshape(h * w)
        frames = frame + torch.arange(t)[:, None] * (h * w)  # (t, h*w)
        order.append(frames.reshape(-1) + offset)
        offset += t * h * w
    return torch.cat(order).to(grid_thw.device)


def _axis_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_corners=True linear taps from an n-long axis into a side-long table: (n, 2) each."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_table_taps(
    grid_thw: torch.Tensor, side: int, spatial_merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) resampling of a side x side learned table to each grid.

    Returns indices (P, 4) into the flattened table and float32 weights (P, 4), taps ordered
    (h0,w0), (h0,w1), (h1,w0), (h1,w1). The caller sums in float32 before casting, as Qwen3-VL does.
    """
    all_idx, all_wts = [], []
    for t, h, w in grid_thw.tolist():
        h_taps, h_wts = _axis_taps(h, side)
        w_taps, w_wts = _axis_taps(w, side)
        idx = h_taps[:, None, :, None] * side + w_taps[None, :, None, :]  # (h, w, 2, 2)
        wts = h_wts[:, None, :, None] * w_wts[None, :, None, :]  # (h, w, 2, 2)
        all_idx.append(_block_major(idx.reshape(h, w, 4), h, w, spatial_merge_size).repeat(t, 1))
        all_wts.append(_block_major(wts.reshape(h, w, 4), h, w, spatial_merge_size).repeat(t, 1))
    return torch.cat(all_idx).to(grid_thw.device), torch.cat(all_wts).to(grid_thw.device)
