"""A reward function served over HTTP (standard library only).

Protocol (one POST per batch, JSON both ways)::

    request:  {"queries": [...], "prompts": [...], "responses": [...],
               "references": [...], "labels": [...], "conversations": [...]}
    response: {"rewards": [r0, r1, ...]}          # one finite number per query

``queries[i]`` is the full sample: ``prompts[i] + responses[i]`` for a string prompt, or the
conversation with the response appended as an assistant message for a chat prompt. ``responses``
is sent as well so a server need not split queries. Servers written for OpenRLHF's remote reward
model protocol read ``queries``/``prompts``/``labels`` and ignore the rest.

``conversations`` (sent when the caller has them; ``null`` entries for prompts without one) are
the chats the prompts were rendered from, with their images: each image part is
``{"type": "image", "image": "data:image/png;base64,..."}``, the PNG of the image exactly as the
actor saw it. PNG because it is lossless (the server's reward model decodes the same pixels, so
remote and local scores are equal), compresses the flat images of rendered boards and documents
to a small fraction of their raw size, and a decoder learns an image's size from its header
before it decodes anything (the server bounds the pixels first). Each video part is sent as the
frames it was sampled to, in order, each a PNG data URL like an image, with the rate they were
sampled at::

    {"type": "video", "video": ["data:image/png;base64,...", ...], "fps": 4.0}

(``fps`` is left out when the part has none; a reward model then takes the frames at its own
``media.video.fps``, as in-process). These are the frames of the part as
:func:`~lightrft.data.conversation` writes it, so the server's reward model re-samples the same
frames at the same rate. The server bounds each frame as an image and all of a request's frames
by count (``--max-video-frames``). Audio parts are not carried: the client refuses them before
sending, naming the part, and the server answers 400 for one (score audio prompts in-process).
Reward models that read conversations (a vision-language reward model or judge) score with the
images and videos behind HTTP as they do in-process.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

from lightrft.config import at_least
from lightrft.data.media import MEDIA_KINDS
from lightrft.rewards.base import Prompt, RewardError, Sample, finite_number

TOKEN_ENV = "LIGHTRFT_REWARD_TOKEN"  # also read by lightrft.rewards.server
PNG_DATA_URL = "data:image/png;base64,"

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class RemoteRewardError(RewardError):
    """The reward server could not be reached or answered something unusable."""


def build_query(prompt: Prompt, response: str) -> Any:
    """The full sample as sent in ``queries``: text, or a conversation ending in the response."""
    if isinstance(prompt, str):
        return prompt + response
    return [dict(m) for m in prompt] + [{"role": "assistant", "content": response}]


def positive_rate(value: Any) -> bool:
    """Whether ``value`` is a video's rate: a positive :func:`finite_number`."""
    return finite_number(value) and value > 0


def _png_url(image: Any, where: str, what: str = "an image part") -> str:
    from PIL import Image

    if isinstance(image, str) and image.startswith(PNG_DATA_URL):
        return image
    if not isinstance(image, Image.Image):
        raise ValueError(
            f"{where}: {what} must hold a PIL image (as the prompt datasets give them) "
            f"or a {PNG_DATA_URL}... string to be sent, got {type(image).__name__}"
        )
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return PNG_DATA_URL + base64.b64encode(buf.getvalue()).decode("ascii")


def _wire_video(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A video part as sent: its frames as PNG data URLs and its ``fps`` (if it has one)."""
    frames = part.get("video")
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ValueError(
            f"{where}: a video part must hold its sampled frames (a non-empty list of PIL "
            "images, as lightrft.data.conversation gives them) to be sent, got "
            f"{type(frames).__name__ if frames is not None else 'no frames'}"
        )
    out: dict[str, Any] = {
        "type": "video",
        "video": [
            _png_url(f, f"{where}.video[{t}]", "a video frame") for t, f in enumerate(frames)
        ],
    }
    fps = part.get("fps")
    if fps is not None:
        if not positive_rate(fps):
            raise ValueError(f"{where}: a video part's fps must be a positive number, got {fps!r}")
        out["fps"] = float(fps)  # a numpy scalar too
    return out


def wire_conversation(conversation: Prompt | None, index: int) -> list[dict[str, Any]] | None:
    """A conversation as sent in ``conversations``: its image parts and video frames as PNG data
    URLs (see the module docstring); ``None`` stays ``None``. Audio parts are refused, naming
    the part (the protocol carries images and video)."""
    if conversation is None:
        return None
    if isinstance(conversation, str):
        raise ValueError(f"conversations[{index}] must be a list of messages, got a string")
    out = []
    for j, m in enumerate(conversation):
        content = m["content"]
        if not isinstance(content, str):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type")
                where = f"conversations[{index}][{j}].content[{k}]"
                if kind == "image":
                    parts.append({"type": "image", "image": _png_url(part.get("image"), where)})
                elif kind == "video":
                    parts.append(_wire_video(part, where))
                elif kind in MEDIA_KINDS:
                    raise ValueError(
                        f"{where}: an {kind} part cannot be sent to a reward server (the "
                        f"protocol carries images and video): score {kind} prompts in-process "
                        "(RewardModel, or GenerativeReward with a local judge)"
                    )
                else:
                    parts.append(dict(part))
            content = parts
        out.append({**m, "content": content})
    return out


def _expire(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    """Mark an attempt expired and shut its socket down, which ends any blocked read."""
    expired.set()
    sock = conn.sock
    if sock is not None:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class RemoteReward:
    """Rewards from an HTTP server, e.g. ``python -m lightrft.rewards.server``.

    A request that times out, cannot connect, or gets HTTP 408/429/5xx is retried up to
    ``max_retries`` times, waiting ``backoff * 2**attempt`` seconds (at most ``max_backoff``)
    in between; other HTTP errors and malformed answers (not JSON, no ``rewards`` list, wrong
    count, a non-number, NaN or infinity) fail at once, since repeating them cannot help.

    ``timeout`` bounds each whole attempt (connect, send, and the complete answer), not each
    socket read: a server trickling bytes is cut off when the attempt's time is up. One batch
    request therefore fails within ``(max_retries + 1) * timeout`` plus the backoff waits
    (``sum(min(max_backoff, backoff * 2**i) for i in range(max_retries))``) plus a little
    scheduling slack.

    Args:
        url: the endpoint, e.g. ``http://127.0.0.1:8000/get_reward``.
        timeout: seconds for one whole attempt.
        max_retries: retries after the first attempt.
        backoff, max_backoff: exponential backoff in seconds.
        batch_size: most samples per request (``None``: the whole batch in one request).
        headers: extra HTTP headers.
        token: sent as ``Authorization: Bearer <token>`` (the server's ``--token``); ``None``
            reads the environment variable ``LIGHTRFT_REWARD_TOKEN`` (unset: no header).

    It sends the samples' conversations, images and video frames as PNG, when they have them
    (the recipes give each prompt's chat). The wire format is the parallel lists above,
    unchanged: servers written for it keep working.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        batch_size: int | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        at_least("timeout", timeout, 0, strict=True)
        at_least("max_retries", max_retries, 0)
        at_least("backoff", backoff, 0)
        at_least("max_backoff", max_backoff, 0)
        at_least("batch_size", batch_size, 1)  # None: the whole batch in one request
        self.url = url
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.batch_size = batch_size
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        chats = None
        if any(s.conversation is not None for s in samples):
            chats = [wire_conversation(s.conversation, i) for i, s in enumerate(samples)]
        step = self.batch_size or max(len(samples), 1)
        rewards: list[float] = []
        for start in range(0, len(samples), step):
            batch = samples[start : start + step]
            payload = {
                "queries": [build_query(s.prompt, s.response) for s in batch],
                "prompts": [s.prompt for s in batch],
                "responses": [s.response for s in batch],
                "references": [s.reference for s in batch],
                "labels": [s.label for s in batch],
            }
            if chats is not None:
                payload["conversations"] = chats[start : start + step]
            rewards += self._validate(self._post(payload), len(batch))
        return rewards

    def _post(self, payload: Mapping[str, Any]) -> bytes:
        body = json.dumps(payload).encode()
        u = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))
            # One POST whose total time is bounded by ``timeout``: a timer shuts the socket down
            # when the time is up, which ends any blocked read (a per-read socket timeout alone
            # lets a trickling server stretch one attempt indefinitely).
            conn = cls(u.hostname, u.port, timeout=self.timeout)
            expired = threading.Event()
            timer = threading.Timer(self.timeout, _expire, (conn, expired))
            timer.daemon = True
            timer.start()
            status = None
            try:
                conn.request("POST", path, body=body, headers=self.headers)
                resp = conn.getresponse()
                status, reason, data = resp.status, resp.reason, resp.read()
            except TimeoutError:
                expired.set()
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            finally:
                timer.cancel()
                conn.close()
            if expired.is_set():
                last = f"no answer within timeout={self.timeout}s"
            elif status == 200:
                return data
            elif status is not None:
                last = f"HTTP {status} {reason}: {data[:300].decode(errors='replace')}"
                if status not in _RETRY_STATUS:
                    raise RemoteRewardError(f"reward server {self.url} answered {last}")
        raise RemoteRewardError(
            f"reward server {self.url} failed {self.max_retries + 1} attempts "
            f"(timeout={self.timeout}s, max_retries={self.max_retries}); last error: {last}"
        )

    def _validate(self, raw: bytes, n: int) -> list[float]:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RemoteRewardError(
                f"reward server {self.url} answered something that is not JSON: {raw[:200]!r}"
            ) from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise RemoteRewardError(
                f"reward server {self.url} answered without a 'rewards' list: {str(data)[:200]}"
            )
        if len(rewards) != n:
            raise RemoteRewardError(
                f"reward server {self.url} returned {len(rewards)} rewards for {n} queries"
            )
        for i, r in enumerate(rewards):
            if not finite_number(r):
                raise RemoteRewardError(
                    f"reward server {self.url} returned {r!r} for query {i}; rewards must be "
                    "finite numbers"
                )
        return [float(r) for r in rewards]
