"""A loss curve as a PNG, written with zlib alone (no plotting library): axes, a light grid and the curve.

``write_curve_png`` returns the pixel of every point it drew, so a test can check the image holds the curve.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

WHITE = (255, 255, 255)
GRID = (225, 225, 225)
AXIS = (60, 60, 60)
CURVE = (31, 119, 180)
MARGIN = 24


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels: list[bytearray], width: int, height: int) -> bytes:
    """8-bit RGB PNG from ``height`` rows of ``3 * width`` bytes (filter type 0 on every row)."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(WHITE * width) for _ in range(height)]

    def put(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.put(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), color)


def write_curve_png(path: str | Path, values: Sequence[float], width: int = 640, height: int = 360
                    ) -> list[tuple[int, int]]:
    """Plot ``values`` against their index into ``path``; returns each value's pixel ``(x, y)``."""
    if len(values) < 2:
        raise ValueError(f"a curve needs at least 2 values, got {len(values)}")
    if width < 4 * MARGIN or height < 4 * MARGIN:
        raise ValueError(f"image {width}x{height} is too small (at least {4 * MARGIN} pixels each way)")
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    canvas = _Canvas(width, height)
    left, right, top, bottom = MARGIN, width - MARGIN, MARGIN, height - MARGIN
    for k in range(1, 5):  # horizontal grid at quarter heights
        y = top + (bottom - top) * k // 4
        canvas.line(left, y, right, y, GRID)
    canvas.line(left, top, left, bottom, AXIS)
    canvas.line(left, bottom, right, bottom, AXIS)
    points = [(left + round((right - left) * i / (len(values) - 1)), bottom - round((bottom - top) * (v - lo) / span))
              for i, v in enumerate(values)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        canvas.line(x0, y0, x1, y1, CURVE)
    Path(path).write_bytes(encode_png(canvas.rows, width, height))
    return points


__all__ = ["CURVE", "encode_png", "write_curve_png"]
