"""Headless Chromium for page tests: the DOM after the page's scripts ran, a screenshot, and a small PNG
decoder (zlib and numpy, no imaging library) to look at the screenshot's pixels."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np

__all__ = ["FLAGS", "chromium", "decode_png", "dump_dom", "screenshot"]

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-dev-shm-usage",
)


def chromium() -> str | None:
    """The Chromium binary (Debian's ``chromium``), or None when it is not installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(binary: str, profile: Path, url: str, *extra: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HOME=str(profile))  # keep Chromium's caches out of the real home
    return subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *extra, url],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def dump_dom(binary: str, page: Path, profile: Path, *, window: tuple[int, int] = (1500, 900)) -> tuple[str, str]:
    """(the serialized DOM after load, Chromium's log) of ``page``."""
    p = _run(binary, profile, page.resolve().as_uri(), f"--window-size={window[0]},{window[1]}", "--dump-dom")
    assert p.returncode == 0, f"chromium --dump-dom failed ({p.returncode}): {p.stderr[-3000:]}"
    return p.stdout, p.stderr


def screenshot(binary: str, page: Path, out: Path, profile: Path, *, window: tuple[int, int] = (1500, 900)) -> str:
    """Write a PNG of ``page`` to ``out``; returns Chromium's log."""
    p = _run(binary, profile, page.resolve().as_uri(), f"--window-size={window[0]},{window[1]}", f"--screenshot={out}")
    assert p.returncode == 0 and out.exists(), f"chromium --screenshot failed ({p.returncode}): {p.stderr[-3000:]}"
    return p.stderr


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit, non-interlaced RGB or RGBA PNG as an array of shape (height, width, channels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG: depth {depth} color {color}"
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 1:  # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(stride)
        elif kind == 2:  # Up
            cur = line + prev
        else:  # Average and Paeth depend on the byte just decoded: one byte at a time
            cur = line.copy()
            up = prev.astype(np.int32)
            for i in range(stride):
                left = int(cur[i - bpp]) & 0xFF if i >= bpp else 0
                ul = int(up[i - bpp]) if i >= bpp else 0
                pred = (left + int(up[i])) // 2 if kind == 3 else _paeth(left, int(up[i]), ul)
                cur[i] = (int(cur[i]) + pred) & 0xFF
        prev = (cur & 0xFF).astype(np.uint8)
        out[y] = prev
    return out.reshape(height, width, bpp)
