"""ShapesWorld drawing primitives: colours, shape kinds, backgrounds, placement and box geometry.

Everything here is a pure function: `render_scene(scene)` redraws an image from the JSON-able scene
description alone (a speckled background carries its own noise seed), so a sample never needs to be
stored. Boxes are in pixel-edge coordinates `[x1, y1, x2, y2]` (a shape fills the pixels
x1 <= x < x2, y1 <= y < y2); `box_to_relative` turns them into Qwen3-VL's relative 0-1000 integers.

Only numpy and Pillow are used (no other vlmkit module).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import zlib
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

# Saturated, clearly distinct colours; every background is light, so each stays visible.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 135, 0),
    "yellow": (230, 200, 0),
    "green": (30, 160, 50),
    "blue": (30, 80, 230),
    "purple": (145, 50, 200),
    "black": (20, 20, 20),
}
KINDS: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "hexagon", "cross")
PLURALS: dict[str, str] = {kind: kind + ("es" if kind.endswith("s") else "s") for kind in KINDS}
SIZES: tuple[str, ...] = ("small", "large")
# Side of a shape's (square) box as a fraction of the image's shorter side; the ranges keep a large
# shape at least 1.5x a small one.
SIZE_FRACTIONS: dict[str, tuple[float, float]] = {"small": (0.15, 0.19), "large": (0.29, 0.35)}
BACKGROUNDS: tuple[str, ...] = ("plain", "striped", "checkered", "speckled")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")  # a video's moving shape goes one way

# Colour-shape pairs that never appear in train or validation images (nor in their questions): one
# per colour and one per kind (black and diamond keep all their pairs), 6 of the 49 pairs (12%).
HELDOUT_COMBOS: tuple[tuple[str, str], ...] = (
    ("red", "star"),
    ("orange", "hexagon"),
    ("yellow", "circle"),
    ("green", "cross"),
    ("blue", "triangle"),
    ("purple", "square"),
)
ALL_COMBOS: tuple[tuple[str, str], ...] = tuple((c, k) for c in COLOURS for k in KINDS)
SEEN_COMBOS: tuple[tuple[str, str], ...] = tuple(p for p in ALL_COMBOS if p not in HELDOUT_COMBOS)


def _star(points: int = 5, inner: float = 0.4) -> list[tuple[float, float]]:
    vertices = []
    for i in range(2 * points):
        radius = 1.0 if i % 2 == 0 else inner
        angle = -math.pi / 2 + i * math.pi / points
        vertices.append((radius * math.cos(angle), radius * math.sin(angle)))
    xs, ys = [v[0] for v in vertices], [v[1] for v in vertices]
    return [((x - min(xs)) / (max(xs) - min(xs)), (y - min(ys)) / (max(ys) - min(ys))) for x, y in vertices]


_T, _U = 1 / 3, 2 / 3
# Each kind as a polygon in the unit box, touching all four sides (the circle is drawn as an ellipse).
POLYGONS: dict[str, list[tuple[float, float]]] = {
    "square": [(0, 0), (1, 0), (1, 1), (0, 1)],
    "triangle": [(0.5, 0), (1, 1), (0, 1)],
    "star": _star(),
    "diamond": [(0.5, 0), (1, 0.5), (0.5, 1), (0, 0.5)],
    "hexagon": [(0.25, 0), (0.75, 0), (1, 0.5), (0.75, 1), (0.25, 1), (0, 0.5)],
    "cross": [(_T, 0), (_U, 0), (_U, _T), (1, _T), (1, _U), (_U, _U), (_U, 1), (_T, 1), (_T, _U), (0, _U),
              (0, _T), (_T, _T)],
}


# ----------------------------------------------------------------------------------------- sizes


def sample_image_size(rng: np.random.Generator, image_size, size_multiple: int = 32,
                      max_aspect: float = 2.0) -> tuple[int, int]:
    """(width, height): `image_size` an int (fixed square), or (lo, hi), each side drawn from the
    multiples of `size_multiple` in [lo, hi] with max(w, h) / min(w, h) <= max_aspect."""
    if isinstance(image_size, (int, np.integer)):
        return int(image_size), int(image_size)
    lo, hi = (int(v) for v in image_size)
    step = max(1, int(size_multiple))
    sides = np.arange(-(-lo // step) * step, hi + 1, step)
    if lo < 32 or hi < lo or len(sides) == 0:
        raise ValueError(f"image_size range {image_size} with size_multiple={size_multiple} gives no side >= 32")
    for _ in range(1000):
        w, h = (int(v) for v in rng.choice(sides, size=2))
        if max(w, h) / min(w, h) <= max_aspect:
            return w, h
    raise ValueError(f"no size in {image_size} has aspect ratio <= {max_aspect}")


def shape_side(rng: np.random.Generator, size: str, width: int, height: int) -> int:
    lo, hi = SIZE_FRACTIONS[size]
    return max(6, int(round(rng.uniform(lo, hi) * min(width, height))))


# ------------------------------------------------------------------------------------ backgrounds


def sample_background(rng: np.random.Generator, kinds: Sequence[str] = BACKGROUNDS) -> dict:
    """A JSON-able background spec: light base colour and, if textured, a low-contrast second tone."""
    kind = str(kinds[int(rng.integers(len(kinds)))])
    level = int(rng.integers(222, 248))
    base = [int(np.clip(level + t, 200, 255)) for t in rng.integers(-8, 9, size=3)]
    spec: dict = {"type": kind, "base": base}
    if kind != "plain":
        delta = int(rng.integers(14, 26))
        spec["dark"] = [v - delta for v in base]
    if kind == "striped":
        spec["period"] = int(rng.integers(6, 17))
        spec["orientation"] = str(rng.choice(["horizontal", "vertical", "diagonal"]))
    elif kind == "checkered":
        spec["period"] = int(rng.integers(6, 17))
    elif kind == "speckled":
        spec["noise_seed"] = int(rng.integers(2**31))
    return spec


def render_background(spec: dict, width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8 pixels of a background spec."""
    base = np.array(spec["base"], dtype=np.int16)
    kind = spec["type"]
    if kind == "plain":
        return np.broadcast_to(base.astype(np.uint8), (height, width, 3)).copy()
    dark = np.array(spec["dark"], dtype=np.int16)
    if kind == "speckled":  # every pixel a random grey step between base and dark
        depth = int((base - dark).max())
        noise = np.random.default_rng(spec["noise_seed"]).integers(0, depth + 1, (height, width, 1), dtype=np.int16)
        return np.maximum(base - noise, dark).astype(np.uint8)
    period = int(spec["period"])  # one dark and one base band per period
    bands = (2 * np.arange(width + height) // period) % 2  # band of each coordinate along a line
    xs, ys = np.arange(width)[None, :], np.arange(height)[:, None]
    if kind == "striped":
        orientation = spec["orientation"]
        band = bands[ys] + 0 * xs if orientation == "horizontal" else bands[xs] + 0 * ys if \
            orientation == "vertical" else bands[xs + ys]
    elif kind == "checkered":
        band = bands[xs] ^ bands[ys]
    else:
        raise ValueError(f"unknown background type {kind!r}")
    return np.take(np.stack([base, dark]).astype(np.uint8), band, axis=0)


# -------------------------------------------------------------------------------------- drawing


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, colour: str | Sequence[int], box: Sequence[int]) -> None:
    """Fill `kind` in `box` with a named colour (COLOURS) or an (r, g, b) triple."""
    x1, y1, x2, y2 = box
    fill = COLOURS[colour] if isinstance(colour, str) else tuple(int(v) for v in colour)
    if kind == "circle":
        draw.ellipse([x1, y1, x2 - 1, y2 - 1], fill=fill)
        return
    w, h = x2 - 1 - x1, y2 - 1 - y1
    draw.polygon([(x1 + u * w, y1 + v * h) for u, v in POLYGONS[kind]], fill=fill)


def render_scene(scene: dict, frame: int | None = None, background: Image.Image | None = None) -> Image.Image:
    """Draw a scene (or frame `frame` of a video scene: the moving shape at its box in that frame);
    `background`, if given, is the already rendered background to draw on (it is copied). A shape
    with an "rgb" entry is drawn in that (r, g, b) instead of its colour name (training-only
    augmentation: its "colour" still names a palette colour, which its labels must then ignore)."""
    width, height = scene["width"], scene["height"]
    if background is None:
        image = Image.fromarray(render_background(scene["background"], width, height), "RGB")
    else:
        image = background.copy()
    draw = ImageDraw.Draw(image)
    motion = scene.get("motion")
    for index, shape in enumerate(scene["shapes"]):
        box = shape["box"]
        if motion is not None and frame is not None and index == motion["target"]:
            box = motion["boxes"][frame]
        draw_shape(draw, shape["kind"], shape.get("rgb", shape["colour"]), box)
    return image


def render_video(scene: dict) -> list[Image.Image]:
    background = Image.fromarray(render_background(scene["background"], scene["width"], scene["height"]), "RGB")
    return [render_scene(scene, frame=t, background=background) for t in range(scene["motion"]["num_frames"])]


def blank_image(width: int, height: int, colour: Sequence[int] = (235, 235, 235)) -> Image.Image:
    return Image.new("RGB", (width, height), tuple(colour))


def encode_png(image: Image.Image, level: int = 1) -> bytes:
    """Lossless RGB PNG bytes, written directly (no row filters, zlib level 1): several times faster than
    Pillow's encoder on these small images, which matters when a dataset stores thousands."""
    pixels = np.asarray(image.convert("RGB"))
    height, width = pixels.shape[:2]
    raw = np.zeros((height, width * 3 + 1), dtype=np.uint8)  # each row: filter type 0, then its bytes
    raw[:, 1:] = pixels.reshape(height, width * 3)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
            + chunk(b"IEND", b""))


def content_hash(images: Image.Image | Sequence[Image.Image]) -> str:
    """sha1 over the size and raw RGB bytes of an image or of every frame of a video."""
    frames = [images] if isinstance(images, Image.Image) else list(images)
    digest = hashlib.sha1()
    for frame in frames:
        frame = frame.convert("RGB")
        digest.update(f"{frame.width}x{frame.height};".encode())
        digest.update(frame.tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ placement


def boxes_clear(a: Sequence[float], b: Sequence[float], gap: float) -> bool:
    """True when boxes a and b are at least `gap` pixels apart along x or along y."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def random_box(rng: np.random.Generator, side: int, width: int, height: int, margin: int) -> list[int] | None:
    if side + 2 * margin > min(width, height):
        return None
    x1 = int(rng.integers(margin, width - margin - side + 1))
    y1 = int(rng.integers(margin, height - margin - side + 1))
    return [x1, y1, x1 + side, y1 + side]


def place_box(rng: np.random.Generator, side: int, width: int, height: int, taken: Sequence[Sequence[float]],
              gap: int, margin: int, tries: int = 100, accept=None) -> list[int] | None:
    """Reject-sample a box of `side` clear of every box in `taken` (and passing `accept`, if given)."""
    for _ in range(tries):
        box = random_box(rng, side, width, height, margin)
        if box is None:
            return None
        if all(boxes_clear(box, other, gap) for other in taken) and (accept is None or accept(box)):
            return box
    return None


def centre(box: Sequence[float]) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def relation(a: Sequence[float], b: Sequence[float], margin: float) -> str | None:
    """Where box a is relative to box b: "left", "right", "above" or "below" when exactly one holds
    clearly (separated by >= margin along one axis, overlapping along the other, and the centre offset
    along that axis at least twice the other), else None."""
    (ax, ay), (bx, by) = centre(a), centre(b)
    dx, dy = ax - bx, ay - by
    gap_x = max(b[0] - a[2], a[0] - b[2])
    gap_y = max(b[1] - a[3], a[1] - b[3])
    if gap_x >= margin and gap_y < 0 and abs(dx) >= 2 * abs(dy):
        return "left" if dx < 0 else "right"
    if gap_y >= margin and gap_x < 0 and abs(dy) >= 2 * abs(dx):
        return "above" if dy < 0 else "below"
    return None


# ---------------------------------------------------------------------------------- box helpers


def box_to_relative(box: Sequence[float], width: int, height: int) -> list[int]:
    """Pixel box -> Qwen3-VL relative box: integers in 0..1000, x * 1000 / width, y * 1000 / height."""
    x1, y1, x2, y2 = box
    scaled = (1000 * x1 / width, 1000 * y1 / height, 1000 * x2 / width, 1000 * y2 / height)
    return [min(1000, max(0, int(round(v)))) for v in scaled]


relative_box = box_to_relative


def relative_to_box(box: Sequence[float], width: int, height: int) -> list[float]:
    """Qwen3-VL relative box (0..1000) -> pixel box (floats)."""
    x1, y1, x2, y2 = box
    return [x1 * width / 1000, y1 * height / 1000, x2 * width / 1000, y2 * height / 1000]


def format_box(box: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(v)) for v in box) + "]"


_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX = re.compile(r"\[" + ",".join([_NUMBER] * 4) + r"\]")


def parse_box(text: str) -> list[float] | None:
    """The first `[x1, y1, x2, y2]` in text, or None."""
    match = _BOX.search(text or "")
    return [float(v) for v in match.groups()] if match else None


def iou(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes (0.0 for a missing or empty box)."""
    if a is None or b is None:
        return 0.0
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


# --------------------------------------------------------------------------------- dense labels


def cell_owners(scene: dict, cell: int = 32, min_share: float = 0.25) -> np.ndarray:
    """(rows, cols) int64: the index in scene["shapes"] of the shape each `cell` px cell shows, or -1
    for background. A cell shows the shape whose box overlaps it most, if that overlap covers at least
    `min_share` of the cell or of the shape's box (so a small shape split across cells still claims its
    largest pieces)."""
    width, height = scene["width"], scene["height"]
    if width % cell or height % cell:
        raise ValueError(f"image {width}x{height} is not a multiple of the {cell} px cell")
    rows, cols = height // cell, width // cell
    owner = np.full((rows, cols), -1, dtype=np.int64)
    edges_x, edges_y = np.arange(cols + 1) * cell, np.arange(rows + 1) * cell
    best = np.zeros((rows, cols))
    for index, shape in enumerate(scene["shapes"]):
        x1, y1, x2, y2 = shape["box"]
        overlap_x = np.clip(np.minimum(edges_x[1:], x2) - np.maximum(edges_x[:-1], x1), 0, None)  # (cols,)
        overlap_y = np.clip(np.minimum(edges_y[1:], y2) - np.maximum(edges_y[:-1], y1), 0, None)  # (rows,)
        overlap = overlap_y[:, None] * overlap_x[None, :]  # (rows, cols) px^2
        enough = overlap >= min_share * min(cell * cell, (x2 - x1) * (y2 - y1))
        wins = enough & (overlap > best)
        owner[wins], best[wins] = index, overlap[wins]
    return owner


def cell_labels(scene: dict, cell: int = 32, min_share: float = 0.25,
                owner: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-cell targets for dense supervision of a vision tower whose tokens each see `cell` px
    (patch 16 x merge 2 = 32), row-major like its merged tokens: (rows, cols) int64 arrays
    "kind" (index into KINDS, len(KINDS) for background), "colour" (index into COLOURS, len(COLOURS)
    for background) and "centre" (1 where a shape's box centre falls in the cell). Which shape a cell
    shows: `cell_owners`, unless `owner` gives it.
    """
    owner = cell_owners(scene, cell, min_share) if owner is None else owner
    rows, cols = owner.shape
    colour_index = {name: i for i, name in enumerate(COLOURS)}
    kinds = np.array([KINDS.index(s["kind"]) for s in scene["shapes"]] + [len(KINDS)], dtype=np.int64)
    colours = np.array([colour_index[s["colour"]] for s in scene["shapes"]] + [len(COLOURS)], dtype=np.int64)
    centre_mask = np.zeros((rows, cols), dtype=np.int64)
    for shape in scene["shapes"]:
        cx, cy = centre(shape["box"])
        centre_mask[min(int(cy // cell), rows - 1), min(int(cx // cell), cols - 1)] = 1
    return {"kind": kinds[owner], "colour": colours[owner], "centre": centre_mask}  # owner -1: the background entry


def video_cell_labels(scene: dict, cell: int = 32, temporal_patch_size: int = 2,
                      min_share: float = 0.25) -> dict[str, np.ndarray]:
    """`cell_labels` for a video scene, one per temporal slice of `temporal_patch_size` frames (the
    last frame repeated to fill the last slice, as the video processor pads), as (T, rows, cols)
    int64 arrays, plus "motion": the index in DIRECTIONS of the way the shape moves on the cells it
    covers in either of the slice's frames, len(DIRECTIONS) ("still") elsewhere. A cell shows the
    shape it shows in the slice's first frame, else the one in its second (the moving shape's
    trail: a token sees both frames)."""
    motion = scene["motion"]
    frames, target = motion["num_frames"], motion["target"]
    padded = list(range(frames)) + [frames - 1] * (-frames % temporal_patch_size)

    def at(frame: int) -> dict:  # the scene with the moving shape where it is in `frame`
        shapes = [dict(s) for s in scene["shapes"]]
        shapes[target]["box"] = motion["boxes"][frame]
        return {**scene, "shapes": shapes}

    out: dict[str, list] = {"kind": [], "colour": [], "centre": [], "motion": []}
    for first in range(0, len(padded), temporal_patch_size):
        slice_frames = padded[first:first + temporal_patch_size]
        first_frame = at(slice_frames[0])
        owner = cell_owners(first_frame, cell, min_share)
        for frame in slice_frames[1:]:
            later = cell_owners(at(frame), cell, min_share)
            owner = np.where(owner >= 0, owner, later)
        labels = cell_labels(first_frame, cell, min_share, owner=owner)  # centre: in the first frame
        for name in ("kind", "colour", "centre"):
            out[name].append(labels[name])
        out["motion"].append(np.where(owner == target, DIRECTIONS.index(motion["direction"]), len(DIRECTIONS)))
    return {name: np.stack(slices).astype(np.int64) for name, slices in out.items()}  # each (T, rows, cols)


def cell_attributes(scene: dict, cell: int = 32, min_share: float = 0.25) -> dict[str, np.ndarray]:
    """What else a cell's token could carry so that a question about the scene needs one look-up, not
    a computation over many tokens (the targets of a structured tower; `cell_labels` has kind, colour
    and centre). Per `cell` px cell, row-major (rows, cols) arrays, the shape being the one the cell
    shows (`cell_owners`):

    - "total": how many shapes the scene holds (every cell, background too);
    - "colour_count" / "kind_count": how many shapes share the shape's colour / kind (0 on
      background, which is also the answer when the question's colour or kind is absent);
    - "size": 0 small, 1 large, 2 background;
    - "rank": the shape's place in the caption's left-to-right order (`caption_of`), len(shapes)
      on background;
    - "background_type": the scene's background type, index into BACKGROUNDS (every cell);
    - "where": (rows, cols, 2) float, the cell's centre as a fraction of the image's width and height;
    - "place": (rows, cols, 2) float, on a shape's cells the cell's centre's offset from the image's
      centre (where - 0.5: -0.5 to 0.5, x first), 0 on background. Pooled over the cells a question
      names, it says on which side of the image they lie, which "where" cannot: its background cells
      pool to the image's centre, whichever cells the shapes hold;
    - "box_digits": (rows, cols, 12) int, the digits a grounding answer writes: hundreds (0-10),
      tens and ones of each relative coordinate (`box_to_relative`), x1's first; 11 on background.
    """
    owner = cell_owners(scene, cell, min_share)
    rows, cols = owner.shape
    shapes, width, height = scene["shapes"], scene["width"], scene["height"]
    colours = [s["colour"] for s in shapes]
    kinds = [s["kind"] for s in shapes]
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i]["centre"][0], shapes[i]["centre"][1]))

    def per_shape(values, background) -> np.ndarray:  # values of shape i at owner i, background at -1
        return np.array([*values, background])[owner]

    where = np.stack(np.meshgrid((np.arange(rows) + 0.5) / rows, (np.arange(cols) + 0.5) / cols, indexing="ij")[::-1], -1)
    digits = [[d for v in box_to_relative(s["box"], width, height) for d in (v // 100, v // 10 % 10, v % 10)] for s in shapes]
    return {
        "total": np.full((rows, cols), len(shapes), dtype=np.int64),
        "colour_count": per_shape([colours.count(c) for c in colours], 0).astype(np.int64),
        "kind_count": per_shape([kinds.count(k) for k in kinds], 0).astype(np.int64),
        "size": per_shape([SIZES.index(s["size"]) for s in shapes], len(SIZES)).astype(np.int64),
        "rank": per_shape([order.index(i) for i in range(len(shapes))], len(shapes)).astype(np.int64),
        "background_type": np.full((rows, cols), BACKGROUNDS.index(scene["background"]["type"]), dtype=np.int64),
        "where": where,  # (rows, cols, 2): x, y
        "place": np.where((owner >= 0)[..., None], where - 0.5, 0.0),  # (rows, cols, 2)
        "box_digits": np.array([*digits, [11] * 12], dtype=np.int64)[owner],  # (rows, cols, 12)
    }
