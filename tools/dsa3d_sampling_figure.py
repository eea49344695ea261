#!/usr/bin/env python3
"""Draws docs/img/dsa3d_sampling.png, the 3D-DSA sampling pattern of docs/3d-dsa.md.

Standard library only (zlib writes the PNG). Three panels are the frames t-1, t, t+1 of a 16x16 token
grid around the query frame; kernel (3, 7, 7). Two queries (red): one inside, one near a corner, where
the regular window is shifted to stay inside the grid (window start = clamp(p - 3, 0, S - 7)).
Grey squares: the regular window r_j; blue dots: the samples P = clamp(start + r_j + delta, 0, S-1)
with a line from their regular position; orange: samples whose position was clamped to the border.
The offsets are a fixed pseudo-random field delta = range * tanh(o), range (h, w) = (3, 3); their t
component moves samples between frames and is not drawn (each sample stays in its kernel row's panel).

    python3 tools/dsa3d_sampling_figure.py [output.png]
"""
import math
import random
import struct
import sys
import zlib

GRID, KH, KW, KT = 16, 7, 7, 3
CELL, MARGIN, GAP, TITLE = 26, 30, 40, 34
PANEL = GRID * CELL
WIDTH = 2 * MARGIN + KT * PANEL + (KT - 1) * GAP
HEIGHT = TITLE + MARGIN + PANEL + MARGIN

WHITE, GRID_DOT, WINDOW = (255, 255, 255), (200, 200, 200), (120, 120, 120)
QUERY, SAMPLE, CLAMPED, LINE, TEXT = (220, 40, 40), (40, 90, 210), (240, 140, 20), (150, 170, 230), (30, 30, 30)

# 5x7 bitmap glyphs for the panel titles.
FONT = {
    "t": ["00100", "00100", "11111", "00100", "00100", "00100", "00011"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    "+": ["00000", "00100", "00100", "11111", "00100", "00100", "00000"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    " ": ["00000"] * 7,
}

pixels = [[WHITE] * WIDTH for _ in range(HEIGHT)]


def put(x, y, color):
    if 0 <= x < WIDTH and 0 <= y < HEIGHT:
        pixels[y][x] = color


def disc(cx, cy, r, color):
    for y in range(int(cy - r) - 1, int(cy + r) + 2):
        for x in range(int(cx - r) - 1, int(cx + r) + 2):
            if (x - cx) ** 2 + (y - cy) ** 2 <= r * r:
                put(x, y, color)


def square(cx, cy, half, color):
    for y in range(int(cy - half), int(cy + half) + 1):
        for x in range(int(cx - half), int(cx + half) + 1):
            if abs(x - cx) >= half - 1.5 or abs(y - cy) >= half - 1.5:
                put(x, y, color)


def line(x0, y0, x1, y1, color):
    steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for i in range(steps + 1):
        a = i / steps
        put(int(round(x0 + a * (x1 - x0))), int(round(y0 + a * (y1 - y0))), color)


def text(x, y, s, scale=3):
    for ch in s:
        for row, bits in enumerate(FONT[ch]):
            for col, bit in enumerate(bits):
                if bit == "1":
                    for dy in range(scale):
                        for dx in range(scale):
                            put(x + col * scale + dx, y + row * scale + dy, TEXT)
        x += 6 * scale


def centre(panel, h, w):
    """Pixel centre of token position (h, w) (fractional allowed) in a panel."""
    x0 = MARGIN + panel * (PANEL + GAP)
    return x0 + (w + 0.5) * CELL, TITLE + MARGIN + (h + 0.5) * CELL


def window_start(p, k, size):
    return min(max(p - k // 2, 0), size - k)


def main(path):
    rng = random.Random(3)
    for panel, title in enumerate(["t-1", "t", "t+1"]):
        x0 = MARGIN + panel * (PANEL + GAP)
        text(x0 + PANEL // 2 - len(title) * 9, 8, title)
        for h in range(GRID):
            for w in range(GRID):
                disc(*centre(panel, h, w), 2.0, GRID_DOT)
    for qh, qw in [(8, 7), (1, 14)]:
        sh, sw = window_start(qh, KH, GRID), window_start(qw, KW, GRID)
        for rt in range(KT):
            for rh in range(KH):
                for rw in range(KW):
                    h, w = sh + rh, sw + rw
                    dh = 3.0 * math.tanh(rng.gauss(0, 0.35))
                    dw = 3.0 * math.tanh(rng.gauss(0, 0.35))
                    ph, pw = min(max(h + dh, 0), GRID - 1), min(max(w + dw, 0), GRID - 1)
                    clamped = (ph, pw) != (h + dh, w + dw)
                    square(*centre(rt, h, w), CELL * 0.28, WINDOW)
                    line(*centre(rt, h, w), *centre(rt, ph, pw), LINE)
                    disc(*centre(rt, ph, pw), 3.2, CLAMPED if clamped else SAMPLE)
        disc(*centre(1, qh, qw), 6.5, QUERY)
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)
    chunk = lambda tag, data: (struct.pack(">I", len(data)) + tag + data +
                               struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)) +
           chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)
    print(f"wrote {path} ({WIDTH}x{HEIGHT})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/dsa3d_sampling.png")
