"""The replay's HTML timeline in headless Chromium: it renders without errors, its lanes carry exactly the
replay's intervals, its data cannot break out of the page, and its screenshot shows the timeline."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from timeslice_orchestrator.replay import Replay, fold_events, render_html, write_html

from .chromium import chromium, decode_png, dump_dom, screenshot
from .replay_streams import alternating

CHROMIUM = chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (scripts/test installs it: apt-get install -y chromium)",
)
EVIL = "</script><script>window.__pwned = 1</script>"


class _Rects(HTMLParser):
    """Every drawn interval (an SVG rect with data-start) and the root element's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.rects: list[dict[str, str]] = []
        self.root: dict[str, str] = {}
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "html":
            self.root = a
        elif tag == "script":
            self.scripts += 1
        elif tag == "rect" and "data-start" in a:
            self.rects.append(a)


def _replay() -> Replay:
    events, _ = alternating(4)
    replay = fold_events(events)
    replay.phases["a"][0].name = EVIL  # data that tries to close the script element
    return replay


def _end(v: str) -> int | None:
    return int(v) if v else None


def _drawn(rects: list[dict[str, str]], cls: str, *keys: str) -> list[tuple[object, ...]]:
    return sorted(
        (*(r[f"data-{k}"] for k in keys), int(r["data-start"]), _end(r["data-end"]))
        for r in rects
        if cls in r["class"].split()
    )


def test_data_is_embedded_safely(tmp_path: Path) -> None:
    replay = _replay()
    page = render_html(replay)
    assert page.count("</script>") == 3  # the error hook, the data, the drawing code: nothing from the data
    # nothing is fetched: no src/href attributes, no CSS imports or remote urls
    assert not re.search(r"\b(?:src|href)\s*=|@import|url\(\s*['\"]?(?:https?:)?//", page)
    raw = re.search(r'<script type="application/json" id="replay-data">(.*?)</script>', page, re.S)
    assert raw is not None
    data = json.loads(raw.group(1))
    assert data["groups"] == json.loads(json.dumps(replay.to_json()))["groups"]
    assert data["phases"]["a"][0]["name"] == EVIL
    write_html(replay, tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == page


@needs_chromium
def test_lanes_in_chromium_match_the_intervals(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    replay = _replay()
    page = tmp_path / "replay.html"
    write_html(replay, page)
    dom, log = dump_dom(CHROMIUM, page, tmp_path / "profile")
    parsed = _Rects()
    parsed.feed(dom)
    assert parsed.root.get("data-rendered") == "1", f"the page's script did not finish: {log[-2000:]}"
    assert "data-errors" not in parsed.root, parsed.root["data-errors"]
    assert not [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert parsed.scripts == 3  # the evil phase name did not become a script element

    g = replay.groups["g"]
    assert _drawn(parsed.rects, "hold", "group", "job", "epoch") == sorted(
        ("g", h.job, str(h.epoch), h.start_ms, h.end_ms) for h in g.holds
    )
    assert _drawn(parsed.rects, "wait", "job", "outcome") == sorted(
        (w.job, w.outcome, w.start_ms, w.end_ms) for w in g.waits
    )
    lanes = replay.nodes.values()
    assert _drawn(parsed.rects, "state", "node", "job", "state") == sorted(
        (lane.node, lane.job, s.state, s.start_ms, s.end_ms) for lane in lanes for s in lane.states
    )
    assert _drawn(parsed.rects, "op", "node", "job", "kind", "epoch", "bytes", "ok") == sorted(
        (lane.node, lane.job, o.kind, str(o.epoch), str(o.bytes), str(o.ok).lower(), o.start_ms, o.end_ms)
        for lane in lanes
        for o in lane.ops
    )
    assert _drawn(parsed.rects, "phase", "job", "name") == sorted(
        (job, p.name, p.start_ms, p.end_ms) for job, spans in replay.phases.items() for p in spans
    )
    duty = f"{replay.summary.groups['g'].duty_cycle * 100:.1f}%"
    assert re.search(rf"<tr data-group=\"g\"><td>g</td><td>{re.escape(duty)}</td>", dom)

    shot = tmp_path / "replay.png"
    screenshot(CHROMIUM, page, shot, tmp_path / "profile2")
    pixels = decode_png(shot.read_bytes())[..., :3]
    assert pixels.shape[:2] == (900, 1500)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 100, f"a nearly blank screenshot: {len(colours)} colours"
    background = np.array([0xF7, 0xF8, 0xFA])
    assert (pixels != background).any(axis=2).mean() > 0.15
    for job_colour in ((0x4E, 0x79, 0xA7), (0xE1, 0x57, 0x59)):  # the first two palette colours: a and b
        assert (pixels == job_colour).all(axis=2).sum() > 2_000, f"no hold bars in {job_colour}"


@needs_chromium
def test_a_script_error_is_caught(tmp_path: Path) -> None:
    """The error check above can fail: a page whose drawing code throws is reported."""
    assert CHROMIUM is not None
    page = tmp_path / "broken.html"
    page.write_text(render_html(_replay()).replace("var rows = [];", "var rows = undefinedThing.rows;"))
    dom, log = dump_dom(CHROMIUM, page, tmp_path / "profile")
    parsed = _Rects()
    parsed.feed(dom)
    assert "undefinedThing" in parsed.root.get("data-errors", "")
    assert [line for line in log.splitlines() if "Uncaught" in line]
    assert parsed.root.get("data-rendered") is None
