"""The loss-curve PNG is a valid PNG (signature, CRCs, IHDR, zlib data) whose pixels hold the curve."""

from __future__ import annotations

import math
import struct
import zlib

import pytest

from zerospeed.profiling.plot import CURVE, write_curve_png


def _decode(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    kinds = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and header is not None
    width, height, depth, color, *_ = header
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    rows = [raw[r * stride:(r + 1) * stride] for r in range(height)]
    assert all(row[0] == 0 for row in rows)  # filter type 0
    return width, height, [row[1:] for row in rows]


def test_png_holds_the_curve(tmp_path) -> None:
    losses = [5.5 * math.exp(-i / 30) + 2.0 for i in range(120)]
    path = tmp_path / "loss.png"
    points = write_curve_png(path, losses, width=400, height=200)
    width, height, rows = _decode(path.read_bytes())
    assert (width, height) == (400, 200) and len(points) == len(losses)
    for x, y in points:
        assert tuple(rows[y][3 * x:3 * x + 3]) == CURVE
    ys = [y for _, y in points]
    assert ys[0] < ys[-1] and ys == sorted(ys)  # falling loss: the curve goes down the image (y grows)
    xs = [x for x, _ in points]
    assert xs == sorted(xs) and xs[0] < xs[-1]
    curve_pixels = sum(tuple(r[i:i + 3]) == CURVE for r in rows for i in range(0, len(r), 3))
    assert curve_pixels >= width // 2  # a connected line, not scattered dots


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        write_curve_png("/tmp/x.png", [1.0])
    with pytest.raises(ValueError, match="too small"):
        write_curve_png("/tmp/x.png", [1.0, 2.0], width=10, height=10)
