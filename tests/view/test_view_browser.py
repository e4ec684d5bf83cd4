"""The ``lightrft view`` page in a real headless browser: it loads with no console error and
fetches nothing, the colour toggle recolours the tokens, the filters, paging and the step
comparison work, multi-turn observations and the record's image show, a record's videos play
or show their frames.

Needs Playwright (``pip install playwright``) and a Chromium it can start: the OS package
(``apt-get install chromium``) or ``LIGHTRFT_CHROMIUM=/path/to/chrome``; ``playwright install``
is not needed. Without either the tests skip and say which is missing (CI has no browser).

    python tests/view/test_view_browser.py PAGE.html SHOT.png   # the docs screenshot of a page
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def find_chromium() -> str | None:
    """A Chromium or Chrome executable: ``LIGHTRFT_CHROMIUM``, else the first on ``PATH``."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return os.environ.get("LIGHTRFT_CHROMIUM") or next(filter(None, map(shutil.which, names)), None)


def _skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if find_chromium() is None:
        return "no Chromium found (apt-get install chromium, or set LIGHTRFT_CHROMIUM)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _browser(playwright):
    # --no-sandbox: CI containers and root users cannot start Chromium's sandbox.
    return playwright.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])


@pytest.fixture
def page(fake_run, tmp_path):
    yield from _open_page(fake_run, tmp_path)


@pytest.fixture
def video_page(video_run, tmp_path):
    yield from _open_page(video_run, tmp_path)


def _open_page(run_dir, tmp_path):
    """The run's page in headless Chromium; after the test, no console error, page error or
    request beyond the file itself and its data URIs."""
    from playwright.sync_api import sync_playwright

    from lightrft.view import write_view

    out, _ = write_view(run_dir, tmp_path / "page.html")
    with sync_playwright() as p:
        browser = _browser(p)
        pg = browser.new_page()
        pg.problems = []
        pg.on("console", lambda m: m.type == "error" and pg.problems.append(m.text))
        pg.on("pageerror", lambda e: pg.problems.append(str(e)))
        # file:// for the page itself, data: for its media; anything else is a fetch
        pg.on(
            "request",
            lambda r: r.url.startswith(("file://", "data:")) or pg.problems.append(r.url),
        )
        pg.goto(out.as_uri())
        yield pg
        assert pg.problems == []
        browser.close()


def _backgrounds(page) -> list[str]:
    return page.eval_on_selector_all("#main .tok", "ns => ns.map(n => n.style.background)")


def test_the_page_loads_and_the_colour_toggle_recolours_tokens(page):
    assert page.locator(".chart").count() == 6
    assert page.locator("#count").inner_text() == "1 / 15 matching (of 15 embedded)"
    assert page.locator("#main img").first.get_attribute("src").startswith("data:image/png")
    assert page.locator("#main audio").count() == 1
    entropy = _backgrounds(page)
    assert len(entropy) == 1 and entropy[0].startswith("rgba(")  # sample "3": one token
    seen = {"entropy": entropy}
    for mode in ("advantage", "ratio", "none"):
        page.check(f'input[name="colour"][value="{mode}"]')
        seen[mode] = _backgrounds(page)
    assert len({tuple(v) for v in seen.values()}) == 4, seen
    assert seen["none"] == [""]
    assert page.locator("#legend .swatch").count() == 0  # nothing to explain


def test_filters_paging_and_multi_turn(page):
    page.fill("#f-rmin", "1")
    assert page.locator("#count").inner_text() == "1 / 9 matching (of 15 embedded)"
    page.fill("#f-rmin", "")
    page.select_option("#f-step", "2")
    page.fill("#f-lmin", "3")
    assert page.locator("#count").inner_text() == "1 / 3 matching (of 15 embedded)"
    page.click("#next")
    page.click("#next")
    assert page.locator("#count").inner_text().startswith("3 / 3")
    assert page.locator("#next").is_disabled()
    # the last match is the multi-turn sample: a turn, its observation, the answer
    blocks = page.locator("#main .block.assistant, #main .block.observation")
    labels = [blocks.nth(i).locator(".label").inner_text() for i in range(blocks.count())]
    assert labels == [
        "assistant turn 1 · 1 tool call",
        "observation (calculator)",
        "assistant turn 2",
    ]
    # observation tokens are not coloured: the trainer does not train on them
    obs = page.eval_on_selector_all(
        "#main .block.observation .tok", "ns => ns.map(n => n.style.background)"
    )
    assert obs and set(obs) == {""}
    page.keyboard.press("ArrowLeft")
    assert page.locator("#count").inner_text().startswith("2 / 3")


def test_the_same_prompt_at_two_steps_side_by_side(page):
    assert page.locator("#compare .sample").count() == 0
    page.select_option("#compare-step", "3")
    assert page.locator("#compare .sample").count() == 4  # its group at step 3
    assert "step 3: 4 samples of this prompt" in page.locator("#compare").inner_text()
    page.click(".chip >> nth=2")  # another sample of the group: the comparison stays
    assert "sample 2" in page.locator("#main .meta b").inner_text()
    assert page.locator("#compare .sample").count() == 4


def test_a_prompt_s_videos_play_or_show_their_frames(video_page):
    page = video_page
    main = page.locator("#main")
    # the H.264 .mp4 as a player the browser decodes (its metadata: the 56x56 frames)
    video = main.locator("video")
    assert video.count() == 1 and video.get_attribute("src").startswith("data:video/mp4;base64,")
    page.wait_for_function("document.querySelector('#main video').readyState >= 2")  # a frame
    assert video.evaluate("v => [v.error, v.videoWidth, v.videoHeight, v.duration > 0]") == [
        None,
        56,
        56,
        True,
    ]
    # the frame list and the .avi's decoded frames as strips, every frame image decoded
    strips = main.locator(".frames")
    assert [strips.nth(i).locator("img").count() for i in range(strips.count())] == [3, 6]
    sizes = main.locator(".frames img").evaluate_all(
        "ns => ns.map(n => n.complete && n.naturalWidth)"
    )
    assert sizes == [56] * 9
    assert "mpeg4 in a .avi file plays in no browser: its frames" in main.inner_text()
    # the other prompt's missing and unreadable files are named
    page.select_option("#f-step", "2")
    text = main.inner_text()
    assert "video gone.mp4: file not found" in text
    assert "video broken.webm: cannot decode it" in text
    assert main.locator("video, .frames").count() == 0


def test_a_video_the_browser_cannot_play_says_so(video_run, video_helpers, tmp_path, monkeypatch):
    # Without PyAV an .mp4 is embedded unprobed; this one holds MPEG-4 Part 2, which no
    # browser decodes: the page says so under the player.
    helpers = video_helpers
    helpers.write_video(video_run.parent / "data" / "square.mp4", helpers.moving_square(6))
    monkeypatch.setitem(sys.modules, "av", None)
    opened = _open_page(video_run, tmp_path)
    page = next(opened)
    page.wait_for_function("document.querySelector('#main video').error !== null")
    player = page.locator("#main .video", has=page.locator("video"))
    assert "this browser cannot play the file" in player.inner_text()
    next(opened, None)  # the checks after the page: no console error, nothing fetched


def screenshot(page_html: str, png: str, width: int = 1500, height: int = 860) -> None:
    """Save a PNG of the page's top (curves, then the first sample whose prompt comes back at
    a later step, beside that step's group)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = _browser(p)
        pg = browser.new_page(viewport={"width": width, "height": height})
        pg.goto(Path(page_html).resolve().as_uri())
        for _ in range(
            pg.eval_on_selector("#count", "n => parseInt(n.textContent.split('/ ')[1])")
        ):
            if pg.locator("#compare-step option").count() > 1:
                pg.select_option("#compare-step", index=1)
                break
            pg.click("#next")
        pg.screenshot(path=png)
        browser.close()


if __name__ == "__main__":
    screenshot(sys.argv[1], sys.argv[2])


@pytest.fixture
def hostile_where_run(fake_run):
    """Every trajectory row's ``where`` is a name on Object.prototype, or worse."""
    import json

    for path in (fake_run / "trajectories").iterdir():
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        names = ["constructor", "__proto__", "toString", "hasOwnProperty", "valueOf"]
        for k, r in enumerate(rows):
            r["where"] = names[k % len(names)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return fake_run


def test_a_hostile_where_breaks_no_script(hostile_where_run, tmp_path):
    """Before: DATA.media["constructor"] was Object's constructor, and mediaBlock threw."""
    for pg in _open_page(hostile_where_run, tmp_path):
        for _ in range(14):  # every sample renders; _open_page asserts no page error
            pg.click("#next")
        assert pg.locator("#count").inner_text() == "15 / 15 matching (of 15 embedded)"


def test_a_run_without_trajectories_shows_its_curves_in_the_browser(fake_run, tmp_path):
    import shutil

    shutil.rmtree(fake_run / "trajectories")
    for pg in _open_page(fake_run, tmp_path):
        assert pg.locator(".chart").count() == 6
        assert "trajectories: true" in pg.locator("#cap").inner_text()
        assert not pg.locator("#pager").is_visible()
