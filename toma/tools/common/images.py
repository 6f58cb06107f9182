"""Images as the commands write them: grids of samples with labels, captioned panels side by side.

torch and PIL load in the functions that use them, so that importing this module for a parser
costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

BUILTIN_UPSCALE = 4  # 32x32 digits are shown at 128x128

LABEL_HEIGHT = 14  # pixels of the strip under each cell that holds its label


def make_grid(
    images: torch.Tensor, ncols: int | None = None, upscale: int = 1, pad: int = 2, labels: Sequence[str] | None = None
) -> Any:
    """Tile images ``(B, C, H, W)`` in ``[0, 1]`` (C = 1 or 3) into one ``PIL.Image``.

    ``labels``: one text per image, written under it (the digit class, say).
    """
    import math

    import torch
    from PIL import Image, ImageDraw

    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (B, 1 or 3, H, W); got {tuple(images.shape)}")
    b, c, h, w = images.shape
    if labels is not None and len(labels) != b:
        raise ValueError(f"labels must give one text per image; got {len(labels)} for {b} images")
    if upscale > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=upscale, mode="nearest")
        h, w = h * upscale, w * upscale
    ncols = ncols or min(b, 10)
    nrows = math.ceil(b / ncols)
    cell_h = h + pad + (LABEL_HEIGHT if labels is not None else 0)
    canvas = torch.ones(c, nrows * cell_h + pad, ncols * (w + pad) + pad)
    for i, img in enumerate(images):
        r, col = divmod(i, ncols)
        y, x = pad + r * cell_h, pad + col * (w + pad)
        canvas[:, y : y + h, x : x + w] = img
    arr = (canvas.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    grid = Image.fromarray(arr[..., 0] if c == 1 else arr).convert("RGB")
    if labels is not None:
        draw = ImageDraw.Draw(grid)
        for i, text in enumerate(labels):
            r, col = divmod(i, ncols)
            draw.text((pad + col * (w + pad) + w / 2, pad + r * cell_h + h + 1), text, fill="black", anchor="ma")
    return grid


def side_by_side(panels: Sequence[tuple[str, Any]]) -> Any:
    """Place labelled ``PIL`` images left to right, each with its caption above it."""
    import math

    from PIL import Image, ImageDraw

    caption_h = 18
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    # a panel is as wide as its image or its caption, whichever is wider
    widths = [max(img.width, math.ceil(measure.textlength(caption))) for caption, img in panels]
    width = sum(widths) + 10 * (len(panels) + 1)
    height = max(img.height for _, img in panels) + caption_h + 20
    out = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(out)
    x = 10
    for (caption, img), w in zip(panels, widths):
        draw.text((x, 6), caption, fill="black")
        out.paste(img, (x, caption_h + 10))
        x += w + 10
    return out
