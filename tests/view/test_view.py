"""``lightrft view``: what the page embeds from a run directory (curves, capped trajectories,
the records' media) and the command's errors. Fast: no model, no browser (test_view_browser.py
drives the page itself)."""

from __future__ import annotations

import base64
import json
import re
import sys
import time
from pathlib import Path

import pytest

from lightrft import cli
from lightrft.view import MEDIA_LIMIT, load_run, render_page


def test_the_page_data_holds_curves_samples_groups_and_media(fake_run):
    data = load_run(fake_run)
    charts = {c["title"]: [line["key"] for line in c["lines"]] for c in data["curves"]}
    assert charts == {
        "reward": ["reward/total/mean", "reward/accuracy/mean"],
        "eval accuracy": ["eval/accuracy", "eval/reward"],
        "KL to reference": ["train/kl"],
        "entropy": ["train/entropy"],
        "response length": ["rollout/response_length/mean"],
        "clip fraction": ["train/clip_frac"],
    }
    clip = next(c for c in data["curves"] if c["title"] == "clip fraction")
    assert clip["lines"][0]["points"] == [[1, 0.1], [3, 0.1]]  # the NaN at step 2 left out
    assert data["cap"]["unreadable_lines"] == 1  # the torn last metrics line
    assert data["tokens"] is True
    samples = data["samples"]
    assert len(samples) == 15 and [s["step"] for s in samples[:5]] == [1] * 5
    # groups: consecutive samples of one prompt; the multi-turn one has a prompt of its own
    assert [s["group"] for s in samples[:5]] == [0, 0, 0, 0, 1]
    assert [s["index"] for s in samples[:5]] == [0, 1, 2, 3, 4]
    media = data["media"]
    first, second = (media[s["where"]] for s in (samples[0], samples[5]))
    assert [m["kind"] for m in first] == ["image", "audio"]
    assert first[0]["uri"].startswith("data:image/png;base64,")
    assert first[1]["uri"].startswith("data:audio/")
    assert second == [{"kind": "image", "name": "gone.png", "missing": "file not found"}]


def test_the_cap_keeps_the_last_steps_and_the_first_samples(fake_run):
    data = load_run(fake_run, steps=2, samples=3)
    assert sorted({s["step"] for s in data["samples"]}) == [2, 3]
    assert len(data["samples"]) == 6
    assert data["cap"] == {
        "no_trajectories": None,
        "steps": 2,
        "samples": 3,
        "max_mib": 64.0,
        "size_cut": False,
        "step_files": 3,
        "shown_steps": [2, 3],
        "total_samples": 10,
        "shown_samples": 6,
        "unreadable_lines": 1,
    }


def test_the_size_limit_keeps_the_newest_samples_first(fake_run):
    full = load_run(fake_run)
    one_step = sum(len(json.dumps(r)) for r in full["samples"] if r["step"] == 3)
    media = sum(len(m.get("uri", "")) for items in full["media"].values() for m in items)
    data = load_run(fake_run, max_mib=(one_step + media + 100) / 2**20)
    assert data["cap"]["size_cut"] is True and data["cap"]["shown_steps"] == [3]
    assert data["samples"] == [r for r in full["samples"] if r["step"] == 3]
    assert data["cap"]["total_samples"] == 5  # the samples of the shown step file
    # a limit under one sample still shows the newest one
    tiny = load_run(fake_run, max_mib=1e-6)
    assert [(r["step"], r["index"]) for r in tiny["samples"]] == [(3, 0)]


def _videos(data: dict, record: int) -> list[dict]:
    where = next(s["where"] for s in data["samples"] if s["where"].endswith(f" line {record}"))
    return [m for m in data["media"][where] if m["kind"] == "video"]


def test_a_record_s_videos_are_embedded_as_a_player_or_frames(video_run):
    data = load_run(video_run)
    frame_list, mp4, avi = _videos(data, 1)
    # a frame list: each frame embedded as the image file it is, in order
    assert frame_list["name"] == "3 frames (frame_0.png .. frame_2.png)"
    assert [f["index"] for f in frame_list["frames"]] == [0, 1, 2]
    assert [f["name"] for f in frame_list["frames"]] == [f"frame_{k}.png" for k in range(3)]
    png = (video_run.parent / "data" / "frame_1.png").read_bytes()
    assert (
        frame_list["frames"][1]["uri"] == "data:image/png;base64," + base64.b64encode(png).decode()
    )
    # an H.264 .mp4 plays in a browser: the file itself, as a data URI
    raw = (video_run.parent / "data" / "square.mp4").read_bytes()
    assert mp4 == {
        "kind": "video",
        "name": "square.mp4",
        "uri": "data:video/mp4;base64," + base64.b64encode(raw).decode(),
    }
    # MPEG-4 Part 2 in an .avi plays in none: its decoded frames instead, saying why
    assert (
        "uri" not in avi and avi["note"] == "mpeg4 in a .avi file plays in no browser: its frames"
    )
    assert [f["index"] for f in avi["frames"]] == list(range(6))
    assert all(f["uri"].startswith("data:image/jpeg;base64,") for f in avi["frames"])
    page = render_page(data)
    assert mp4["uri"] in page and frame_list["frames"][1]["uri"] in page
    assert avi["frames"][5]["uri"] in page


def test_a_long_frame_list_shows_frames_spread_evenly(video_run):
    data_dir = video_run.parent / "data"
    rec = {"prompt": "1+2=", "videos": [[f"frame_{k % 3}.png" for k in range(40)]]}
    (data_dir / "train.jsonl").write_text(json.dumps(rec) + "\n")
    (video,) = _videos(load_run(video_run), 1)
    assert video["note"] == "16 of its 40 frames, spread evenly"
    assert [f["index"] for f in video["frames"]][:4] == [0, 3, 5, 8]
    assert video["frames"][-1]["index"] == 39


def test_a_missing_or_unreadable_video_is_noted(video_run):
    data = load_run(video_run)
    broken, gone = _videos(data, 2)  # the record's field, then its messages' video part
    assert gone == {"kind": "video", "name": "gone.mp4", "missing": "file not found"}
    assert broken["name"] == "broken.webm"
    assert broken["missing"].startswith("cannot decode it (InvalidDataError: ")
    # a frame list with a missing frame shows the others and names the missing one
    data_dir = video_run.parent / "data"
    rec = {"prompt": "1+2=", "videos": [["frame_0.png", "no_frame.png"]]}
    (data_dir / "train.jsonl").write_text(json.dumps(rec) + "\n")
    (video,) = _videos(load_run(video_run), 1)
    assert video["frames"][0]["uri"].startswith("data:image/png;base64,")
    assert video["frames"][1] == {"index": 1, "name": "no_frame.png", "missing": "file not found"}


def test_a_video_over_the_size_guard_is_named_not_embedded(video_run):
    big = video_run.parent / "data" / "square.mp4"
    with open(big, "ab") as f:  # over the guard: never read, so its bytes do not matter
        f.write(b"\0" * MEDIA_LIMIT)
    data = load_run(video_run)
    assert _videos(data, 1)[1] == {
        "kind": "video",
        "name": "square.mp4",
        "missing": "over 2 MiB, not embedded",
    }
    page = render_page(data)
    assert "data:video/mp4" not in page and len(page) < MEDIA_LIMIT


def test_the_size_limit_counts_a_video_s_frames(video_run):
    full = load_run(video_run)
    newest = [r for r in full["samples"] if r["step"] == 3]
    uris = sum(len(m.get("uri", "")) for m in full["media"][newest[0]["where"]])
    # room for the newest step and its record's data URIs, but not the frames: one sample
    data = load_run(video_run, max_mib=(sum(len(json.dumps(r)) for r in newest) + uris) / 2**20)
    assert data["cap"]["size_cut"] is True and len(data["samples"]) == 1


def test_without_pyav_a_playable_file_is_embedded_and_another_is_named(video_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    frame_list, mp4, avi = _videos(load_run(video_run), 1)
    assert mp4["uri"].startswith("data:video/mp4;base64,")
    assert mp4["note"] == "codec not checked: PyAV is not installed (pip install av)"
    assert avi["missing"] == (
        "a .avi file plays in no browser, and showing its frames needs PyAV (pip install av)"
    )
    assert len(frame_list["frames"]) == 3  # image files: no PyAV needed


def test_a_run_without_metrics_or_tokens_still_gets_a_page(fake_run):
    (fake_run / "metrics.jsonl").unlink()
    for path in (fake_run / "trajectories").iterdir():
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps({k: v for k, v in r.items() if k != "tokens"}) + "\n" for r in lines)
        )
    data = load_run(fake_run)
    assert data["curves"] == [] and data["metrics_file"] is False and data["tokens"] is False


def test_the_data_cannot_close_the_script_tag(fake_run):
    path = fake_run / "trajectories" / "step_000001.jsonl"
    rec = json.loads(path.read_text().splitlines()[0])
    rec["response"] = "</script><script>alert(1)</script>"
    path.write_text(json.dumps(rec) + "\n")
    page = render_page(load_run(fake_run))
    assert page.count("</script>") == 2  # the data block's and the code's own
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert json.loads(blob[1])["samples"][0]["response"] == rec["response"]


def test_the_command_writes_one_self_contained_file(fake_run, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert cli.main(["view", str(fake_run), "--out", str(out), "--steps", "2"]) == 0
    assert re.match(
        rf"wrote {re.escape(str(out))} \(\d+\.\d MiB\): 6 charts, 10 samples",
        capsys.readouterr().out,
    )
    page = out.read_text()
    # nothing to fetch: no external script, style, image or link
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", page)
    assert "https://" not in page and "cdn" not in page.lower()
    assert cli.main(["view", str(fake_run)]) == 0
    assert (fake_run / "view.html").is_file()


@pytest.mark.parametrize(
    "make,args,message",
    [
        (None, ["--steps", "1"], "run directory not found"),
        (
            "empty",
            [],
            "has neither metrics.jsonl nor saved trajectories.*trajectories: true.*"
            "trajectory_tokens: true",
        ),
        ("run", ["--out", "/no/such/folder/page.html"], "folder /no/such/folder does not exist"),
        ("run", ["--steps", "0"], "--steps and --samples must be >= 1 and --max-mib > 0, got 0"),
        ("run", ["--max-mib", "0"], "--max-mib > 0, got 20, 64 and 0.0"),
    ],
)
def test_command_errors_exit_2_with_one_line(fake_run, tmp_path, capsys, make, args, message):
    target = {None: tmp_path / "missing", "empty": tmp_path / "data", "run": fake_run}[make]
    assert cli.main(["view", str(target), *args]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err


# Hostile runs and data: a page is made to be shared, so it never holds bytes from outside the
# run and data folders, and no line of a run's files ends `view` with a traceback.


def _hostile_record(fake_run: Path, record: dict) -> Path:
    """``record`` appended to the run's data file, and every trajectory row pointing at it."""
    data = fake_run.parent / "data" / "train.jsonl"
    with open(data, "a") as f:
        f.write(json.dumps(record) + "\n")
    n = len(data.read_text().splitlines())
    for path in (fake_run / "trajectories").iterdir():
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for r in rows:
            r["where"] = f"{data} line {n}"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data.parent


def _embedded(page: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r"data:[^;\"]+;base64,([A-Za-z0-9+/=]+)", page)]


def test_files_outside_the_run_and_data_folders_are_named_not_embedded(fake_run, monkeypatch):
    """Before: all of these went into view.html as base64, the viewing process's environment
    (HF_TOKEN) included."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_4c1d")
    data = fake_run.parent / "data"
    outside = fake_run.parent / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"\x89PNG\r\n\x1a\nsecret-bytes-9e2")
    (data / "link.png").symlink_to(outside / "secret.png")  # a link out of the data folder
    (data / "passwd_link.wav").symlink_to("/etc/passwd")
    (data / "text.png").write_text("root:x:0:0:not an image")  # decodes as no image
    hostile = ["/etc/passwd", "../../../../etc/hostname", "/proc/self/environ", "link.png"]
    _hostile_record(
        fake_run,
        {
            "prompt": "p",
            "images": [*hostile, "text.png", "red.png"],
            "audios": ["passwd_link.wav", "/proc/self/environ"],
            "videos": ["/etc/passwd", ["/proc/self/environ", "../outside/secret.png"]],
        },
    )
    data_out = load_run(fake_run)
    (items,) = data_out["media"].values()
    by_name = {m["name"]: m for m in items}
    for name in [*hostile, "passwd_link.wav"]:
        assert by_name[name]["missing"] == "outside the run and data folders: not embedded"
    assert by_name["text.png"]["missing"] == "not an image file: not embedded"
    assert "uri" in by_name["red.png"]  # the record's own image still shows
    frames = next(m for m in items if m["kind"] == "video" and "frames" in m)["frames"]
    assert all(f["missing"].startswith("outside the run") for f in frames)
    page = render_page(data_out)
    blobs = _embedded(page)
    assert len(blobs) == 1  # red.png, nothing else
    for blob in blobs:
        assert (
            b"root:" not in blob and b"hf_secret_token" not in blob and b"secret-bytes" not in blob
        )
    assert "hf_secret_token" not in page and "secret-bytes" not in page


def test_line_0_names_no_record(fake_run):
    """Lines count from 1: ``line 0`` showed the data file's last record's media."""
    data = _hostile_record(fake_run, {"prompt": "p", "images": ["red.png"]}) / "train.jsonl"
    assert load_run(fake_run)["media"]  # the record's image, as ``line N`` names it
    for path in (fake_run / "trajectories").iterdir():
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for r in rows:
            r["where"] = f"{data} line 0"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_run(fake_run)["media"] == {}


def test_a_hostile_where_is_only_a_string(fake_run):
    path = fake_run / "trajectories" / "step_000001.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r, where in zip(rows, ["constructor", "__proto__", {"a": 1}, 7, None], strict=False):
        r["where"] = where
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_run(fake_run)
    assert set(data["media"]) <= {
        r["where"] for r in data["samples"] if isinstance(r["where"], str)
    }


def test_hostile_metrics_and_trajectory_lines_are_counted_not_raised(fake_run, tmp_path):
    """Before: a 5000-digit integer raised ValueError, a 5000-deep line RecursionError, and a
    step file linked to /dev/zero read without bound."""
    with open(fake_run / "metrics.jsonl", "a") as f:
        f.write('\n{"step": 9, "train/kl": ' + "9" * 5000 + "}\n")
    with open(fake_run / "trajectories" / "step_000003.jsonl", "a") as f:
        f.write("[" * 5000 + "]" * 5000 + "\n" + '{"a": ' + "[" * 5000 + "]" * 5000 + "}\n")
    (fake_run / "trajectories" / "step_000004.jsonl").symlink_to("/dev/zero")
    start = time.monotonic()
    data = load_run(fake_run)
    assert time.monotonic() - start < 5
    assert data["cap"]["step_files"] == 3  # the link to a device is no step file
    assert data["cap"]["unreadable_lines"] == 1 + 1 + 2  # the torn line, the int, two deep
    assert render_page(data)


def test_a_run_without_trajectories_shows_its_curves_and_says_how(fake_run, capsys):
    """Before: refused ("has no saved trajectories")."""
    import shutil

    shutil.rmtree(fake_run / "trajectories")
    data = load_run(fake_run)
    assert data["curves"] and data["samples"] == []
    assert "trajectories: true" in data["cap"]["no_trajectories"]
    assert cli.main(["view", str(fake_run)]) == 0
    out = capsys.readouterr().out
    assert "0 samples of 0 steps" in out and "run the recipe with `trajectories: true`" in out
