"""A small reference reward server: any LightRFT reward function behind HTTP (``http.server``).

    python -m lightrft.rewards.server --port 8000 --verifier math
    python -m lightrft.rewards.server --port 8000 \\
        --component lightrft.rewards.RewardModel --kwargs '{"path": "/models/rm", "device": "cuda"}'

It answers POST requests on any path with the protocol of :mod:`lightrft.rewards.remote`, and
``GET /health`` with ``{"status": "ok"}``. Requests are scored one at a time (a lock), since a
reward model on one device gains nothing from overlapping calls. Every failure gets an HTTP
error with ``{"error": message}``, never a dropped connection: 400 malformed body (an entry of
``conversations`` too, named: ``'conversations'[0][0].content[1].video[3]: ...``; an audio part
is refused: the protocol carries images and video), 401 missing or wrong token, 408 request
(line, headers and body: one deadline) not received within ``--read-timeout``, 411 no
``Content-Length``, 413 body over ``--max-body-mb``, an image or video frame of
``conversations`` over ``--max-image-pixels`` / ``--max-request-pixels``, or more video frames
than ``--max-video-frames``, 422 the reward
function refused the batch as given (:class:`~lightrft.rewards.base.RewardInputError`: a sample
without its reference answer, code tests that cannot be read), 503 more than ``--max-connections`` open connections, 500 the
reward function failed.

Media: ``conversations`` carry images and videos as the client sends them
(:mod:`lightrft.rewards.remote`): an image part ``{"type": "image", "image": "data:image/png;
base64,..."}``; a video part ``{"type": "video", "video": [frame, ...], "fps": r}``, its
sampled frames in order, each a PNG data URL, and ``fps`` (optional; a positive number) the rate
they were sampled at. Every image and every frame is checked from its PNG header before any
pixel is decoded: one against ``--max-image-pixels``, all of a request's together against
``--max-request-pixels`` (a frame counts as an image: a long video cannot bring in more pixels
than images could), and a request's video frames together against ``--max-video-frames``. The
frames of a video must share one size. The reward function gets each part decoded as it would
in-process (:func:`~lightrft.data.conversation`): an image part's ``image`` and a video part's
frames as RGB PIL images, the video's ``fps`` as a float, so a reward model or judge behind the
server scores as it does in-process.

Floods: a connection has ``--read-timeout`` seconds in all to deliver its request, however it
trickles; the listen backlog holds :data:`LISTEN_BACKLOG` connections (the standard library's
default of 5 makes a burst's clients wait for SYN retries, up to a minute), and connections past
``--max-connections`` are answered 503 at once by the accepting thread. Every connection ends
with a lingering close (reply, half-close, read and discard what the client still sends until it
closes, for at most :data:`LINGER_SECONDS`), as production servers do: closing a socket with
unread bytes makes the kernel reset the connection, and the client can lose the answer with it.

Security: it binds to 127.0.0.1 unless told otherwise. ``--token`` (or the environment variable
``LIGHTRFT_REWARD_TOKEN``) makes every request carry ``Authorization: Bearer <token>``;
:class:`~lightrft.rewards.RemoteReward` sends it from its ``token`` argument or the same
variable. The token travels in clear over ``http://``: across machines, put the server behind
TLS (a reverse proxy) and use an ``https://`` URL.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightrft.config import at_least
from lightrft.rewards.base import (
    RewardInputError,
    Sample,
    check_reward_output,
    check_signature,
    instantiate_node,
)
from lightrft.rewards.remote import PNG_DATA_URL, TOKEN_ENV, positive_rate

# Pending connections the kernel queues for accept() (capped by net.core.somaxconn on Linux).
LISTEN_BACKLOG = 1024
# How long a connection is read (and discarded) after its reply, waiting for the client to close.
LINGER_SECONDS = 2.0
_MAX_LINGERING = 256  # 503'd connections draining at once

# Bounds on the images of ``conversations``, checked from each PNG's header before it is decoded:
# a few kilobytes of PNG can announce gigapixels.
MAX_IMAGE_PIXELS = 4096 * 4096  # one image
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS  # all images and video frames of one request
# Video frames of one request together (each frame also counts against the pixel bounds): 8
# conversations of 32 frames, the prompt datasets' default ``media.video.max_frames``.
MAX_VIDEO_FRAMES = 256

VERIFIERS = {
    "math": "lightrft.rewards.MathVerifier",
    "gsm8k": "lightrft.rewards.GSM8KVerifier",
    "format": "lightrft.rewards.ThinkFormatReward",
    "code": "lightrft.rewards.CodeVerifier",
}


class MediaTooLarge(ValueError):
    """An image or video of a request is over the server's pixel or frame bounds (answered
    HTTP 413)."""


@dataclass(frozen=True)
class MediaBounds:
    """The server's bounds on the images and video frames of one request's ``conversations``."""

    image_pixels: int = MAX_IMAGE_PIXELS  # one image or video frame (--max-image-pixels)
    request_pixels: int = MAX_REQUEST_PIXELS  # all of them together (--max-request-pixels)
    video_frames: int = MAX_VIDEO_FRAMES  # all video frames together (--max-video-frames)


@dataclass
class _Budget:
    """What is left of one request's :class:`MediaBounds` while its media are decoded."""

    bounds: MediaBounds
    pixels: int
    frames: int


def _decode_png(url: Any, where: str, budget: _Budget, kind: str = "image"):
    """The RGB PIL image of a PNG data URL (an image, or a video ``kind="frame"``), its size
    checked against the per-image bound and what is left of the request's before any pixel is
    decoded."""
    from PIL import Image

    if not isinstance(url, str) or not url.startswith(PNG_DATA_URL):
        what = "an image" if kind == "image" else "a frame"
        raise ValueError(f"{where}: {what} must be a string starting {PNG_DATA_URL!r}")
    try:
        data = base64.b64decode(url[len(PNG_DATA_URL) :], validate=True)
    except ValueError:  # binascii.Error is one
        raise ValueError(f"{where}: the {kind} is not valid base64") from None
    try:
        img = Image.open(io.BytesIO(data), formats=["PNG"])  # reads the header only
    except Image.DecompressionBombError as e:
        raise MediaTooLarge(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - PIL raises several types for bad data
        raise ValueError(f"{where}: not a PNG image ({type(e).__name__}: {e})") from None
    w, h = img.size
    if w * h > budget.bounds.image_pixels:
        raise MediaTooLarge(
            f"{where}: {kind} of {w}x{h} = {w * h} pixels is over the server's limit of "
            f"{budget.bounds.image_pixels} pixels per image (--max-image-pixels)"
        )
    if w * h > budget.pixels:
        raise MediaTooLarge(
            f"{where}: the request's images and video frames are over the server's limit of "
            f"{budget.bounds.request_pixels} pixels per request (--max-request-pixels)"
        )
    budget.pixels -= w * h
    try:
        img.load()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{where}: cannot decode the PNG ({type(e).__name__}: {e})") from None
    return img.convert("RGB") if img.mode != "RGB" else img


def _decode_video(part: dict, where: str, budget: _Budget) -> dict[str, Any]:
    """A video part (``{"type": "video", "video": [PNG data URL, ...], "fps": r}``) with its
    frames decoded by :func:`_decode_png`, each counted as an image against the pixel bounds
    and against what is left of the request's video frames."""
    frames, fps = part.get("video"), part.get("fps")
    if not isinstance(frames, list):
        raise ValueError(
            f"{where}.video must be a list of frames (PNG data URLs), got {type(frames).__name__}"
        )
    if not frames:
        raise ValueError(f"{where}.video has no frames (an empty list)")
    if fps is not None and not positive_rate(fps):
        raise ValueError(
            f"{where}.fps must be a positive number (the rate the frames were sampled at), "
            f"got {str(fps)[:40]}"
        )
    if len(frames) > budget.frames:
        raise MediaTooLarge(
            f"{where}: a video of {len(frames)} frames takes the request over the server's limit "
            f"of {budget.bounds.video_frames} video frames per request (--max-video-frames); "
            "send fewer conversations per request (RemoteReward's batch_size) or sample fewer "
            "frames"
        )
    budget.frames -= len(frames)
    out = []
    for t, url in enumerate(frames):
        img = _decode_png(url, f"{where}.video[{t}]", budget, "frame")
        if out and img.size != out[0].size:
            raise ValueError(
                f"{where}.video[{t}]: frame of {img.size[0]}x{img.size[1]} differs in size from "
                f"the video's first frame ({out[0].size[0]}x{out[0].size[1]})"
            )
        out.append(img)
    decoded: dict[str, Any] = {"type": "video", "video": out}
    if fps is not None:
        decoded["fps"] = float(fps)
    return decoded


def decode_conversations(value: Any, n: int, bounds: MediaBounds = MediaBounds()) -> list | None:
    """A request's ``conversations`` (``None`` if absent) with their PNG images and video
    frames decoded to PIL images, as a reward function reads them in-process (see the module
    docstring); ``ValueError`` naming the entry, or :class:`MediaTooLarge`, for anything else.
    Media travel inline only: a path is refused (the server must not read its own files for a
    client)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise ValueError(f"'conversations' must be a list of {n} entries")
    budget = _Budget(bounds, bounds.request_pixels, bounds.video_frames)
    out: list = []
    for i, chat in enumerate(value):
        if chat is None:
            out.append(None)
            continue
        if not isinstance(chat, list) or not chat:
            raise ValueError(f"'conversations'[{i}] must be a non-empty list of messages or null")
        messages = []
        for j, m in enumerate(chat):
            where = f"'conversations'[{i}][{j}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"{where} must be a message with a string 'role'")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for k, part in enumerate(content):
                    at = f"{where}.content[{k}]"
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        parts.append({"type": "text", "text": part["text"]})
                    elif kind == "image":
                        img = _decode_png(part.get("image"), at, budget)
                        parts.append({"type": "image", "image": img})
                    elif kind == "video":
                        parts.append(_decode_video(part, at, budget))
                    elif kind == "audio":
                        raise ValueError(
                            f"{at}: an audio part is not carried by the reward server (images "
                            "and video only); score audio prompts in-process"
                        )
                    else:
                        raise ValueError(
                            f"{at} must be a text part with a string 'text', an image part (PNG "
                            "data URL) or a video part (a list of PNG data URL frames), got "
                            f"{str(part)[:60]}"
                        )
                content = parts
            elif not isinstance(content, str):
                raise ValueError(f"{where}.content must be a string or a list of parts")
            messages.append({"role": m["role"], "content": content})
        out.append(messages)
    return out


def split_requests(data: Any, bounds: MediaBounds = MediaBounds()) -> list[Sample]:
    """The samples of a request body (the wire format's parallel lists, one
    :class:`~lightrft.rewards.Sample` per entry), or ``ValueError`` saying what is wrong
    (:class:`MediaTooLarge` for media over the pixel or frame bounds).

    ``responses`` is used if present; otherwise each response is its query with the prompt
    removed from the front (or the last message's content, for a conversation query).
    ``conversations``, when present, is decoded by :func:`decode_conversations`.
    """
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    queries = data.get("queries")
    responses = data.get("responses")
    if responses is None and queries is None:
        raise ValueError("the request needs 'queries' or 'responses'")
    n = len(responses if responses is not None else queries)
    args: dict[str, list] = {}
    for key in ("queries", "prompts", "responses", "references", "labels"):
        val = data.get(key)
        if val is not None and (not isinstance(val, list) or len(val) != n):
            raise ValueError(f"'{key}' must be a list of {n} entries")
        args[key] = val
    for key, types, what in (
        ("labels", (str, type(None)), "strings or null"),
        ("prompts", (str, list), "strings or message lists"),
    ):
        for i, v in enumerate(args[key] or []):
            if not isinstance(v, types):
                raise ValueError(f"'{key}'[{i}] is a {type(v).__name__}; {key} must hold {what}")
    prompts = args["prompts"] or [""] * n
    if responses is None:
        responses = []
        for i, (q, p) in enumerate(zip(queries, prompts, strict=True)):
            if isinstance(q, list):  # a conversation: the response is the last message
                if not all(
                    isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in q
                ):
                    raise ValueError(
                        f"'queries'[{i}] must be a list of messages "
                        '({"role": ..., "content": "<string>"})'
                    )
                responses.append(q[-1].get("content", "") if q else "")
            elif not isinstance(q, str):
                raise ValueError(
                    f"'queries'[{i}] is a {type(q).__name__}; queries must hold strings or "
                    "message lists"
                )
            else:
                responses.append(q[len(p) :] if isinstance(p, str) and q.startswith(p) else q)
    if not all(isinstance(r, str) for r in responses):
        raise ValueError("'responses' must hold strings")
    conversations = decode_conversations(data.get("conversations"), n, bounds)
    return Sample.batch(prompts, responses, args["references"], args["labels"], conversations)


class _HTTPError(Exception):
    """An error answer of the handler: ``args`` are its HTTP status code and message."""


def _raw_reply(code: int, message: str) -> bytes:
    """A complete JSON error response, for where the handler's own replies cannot be used."""
    body = json.dumps({"error": message}).encode()
    reason = BaseHTTPRequestHandler.responses[code][0]
    return (
        f"HTTP/1.0 {code} {reason}\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _caused_by_input(e: BaseException) -> bool:
    """Whether ``e`` is, or was raised from (``raise ... from``), a :class:`RewardInputError`."""
    for _ in range(20):  # a cause chain is short; a cycle must not loop forever
        if isinstance(e, RewardInputError):
            return True
        e = getattr(e, "__cause__", None)  # None past the chain's end
    return False


class _DeadlineReader(io.RawIOBase):
    """A connection's socket read under one deadline per request (``deadline``, a monotonic time
    the handler sets as each request begins): each read waits only for what is left of it, so a
    client trickling its request line, headers or body a byte at a time is cut off when the
    deadline passes (a per-read timeout would not)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.deadline, self.timed_out = sock, 0.0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            raise TimeoutError("the request deadline passed")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            self.timed_out = True
            raise


def _lingering_close(sock: socket.socket, seconds: float) -> None:
    """Half-close ``sock``, discard what the peer still sends until it closes (at most
    ``seconds``; ``seconds=0``: only what has already arrived), then close it. Without the
    drain, bytes that land after the reply make the kernel answer with a reset, and a client
    still sending its request fails before it reads the reply."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    end = time.monotonic() + seconds
    with suppress(OSError):
        while True:
            # A timeout of 0 is non-blocking: an empty buffer's BlockingIOError ends the drain.
            sock.settimeout(max(end - time.monotonic(), 0.0))
            if not sock.recv(65536):
                break  # the client closed
    sock.close()


class _BoundedServer(ThreadingHTTPServer):
    """A threading server that serves at most ``max_connections`` connections at once and
    answers the next ones with HTTP 503 at once, so floods cannot exhaust threads."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, addr: tuple[str, int], handler: type, max_connections: int):
        super().__init__(addr, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lingering = threading.BoundedSemaphore(_MAX_LINGERING)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_raw_reply(503, "server busy: too many open connections"))
            self._close_later(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown_request(self, request: Any) -> None:  # a handler thread ends its connection
        _lingering_close(request, LINGER_SECONDS)

    def _close_later(self, request: Any) -> None:
        """A lingering close off the accepting thread (which must never wait), in a short-lived
        thread; past :data:`_MAX_LINGERING` of them at once, drain only what has arrived."""
        if not self._lingering.acquire(blocking=False):
            _lingering_close(request, 0.0)
            return

        def linger() -> None:
            try:
                _lingering_close(request, LINGER_SECONDS)
            finally:
                self._lingering.release()

        threading.Thread(target=linger, daemon=True).start()


def make_server(
    reward_fn: Callable[..., Any],
    host: str = "127.0.0.1",
    port: int = 0,
    verbose: bool = False,
    *,
    token: str | None = None,
    max_body_bytes: int = 64 * 2**20,
    read_timeout: float = 30.0,
    max_connections: int = 32,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    max_request_pixels: int = MAX_REQUEST_PIXELS,
    max_video_frames: int = MAX_VIDEO_FRAMES,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) that scores requests with ``reward_fn``.

    ``port=0`` picks a free port: read it from ``server.server_address[1]``. Run it with
    ``server.serve_forever()`` (e.g. in a thread) and stop it with ``server.shutdown()``.

    Args:
        token: if set, requests must carry ``Authorization: Bearer <token>`` (else HTTP 401).
        max_body_bytes: larger ``Content-Length`` is refused with HTTP 413 before reading.
        read_timeout: seconds a connection may take to send its whole request: request line,
            headers and body together (a deadline, not per read: a trickling client is cut off);
            past it the client gets HTTP 408 and the connection is closed.
        max_connections: connections served at once; more are answered HTTP 503.
        max_image_pixels, max_request_pixels: bounds on the images and video frames of
            ``conversations`` (one image or frame; all of a request's), read from each PNG's
            header before decoding; over them the request is answered HTTP 413.
        max_video_frames: the most video frames of one request (all its video parts); more
            are answered HTTP 413.

    Each request's parallel lists (the wire format, unchanged) become one
    :class:`~lightrft.rewards.Sample` each, conversations included, and ``reward_fn`` scores the
    list.
    """
    for key, value in (
        ("max_body_bytes", max_body_bytes),
        ("max_connections", max_connections),
        ("max_image_pixels", max_image_pixels),
        ("max_request_pixels", max_request_pixels),
        ("max_video_frames", max_video_frames),
    ):
        at_least(key, value, 1)
    at_least("read_timeout", read_timeout, 0, strict=True)
    check_signature("the served reward function", reward_fn)
    bounds = MediaBounds(max_image_pixels, max_request_pixels, max_video_frames)
    lock = threading.Lock()
    expected = token.encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout  # socket timeout while writing a reply

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.deadline = time.monotonic() + read_timeout
            self._reader.timed_out = False
            super().handle_one_request()  # a timeout there closes the connection silently
            if self._reader.timed_out:
                self.close_connection = True
                with suppress(OSError):
                    self.connection.settimeout(1.0)
                    self.wfile.write(
                        _raw_reply(408, f"request not received within {read_timeout}s")
                    )

        def _reply(self, code: int, obj: Any) -> None:
            self.connection.settimeout(read_timeout)
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if code >= 400 and code != 500:
                # the unread rest of the body would be parsed as the next request
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes:
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise _HTTPError(411, "a Content-Length header is required")
            if not raw.strip().isdecimal():  # 1*DIGIT (RFC 9110): no sign, no underscores
                raise _HTTPError(400, f"bad Content-Length {raw[:40]!r}")
            length = int(raw)
            if length > max_body_bytes:
                raise _HTTPError(
                    413, f"body of {length} bytes exceeds the limit of {max_body_bytes} bytes"
                )
            # The reader keeps to the request's deadline: past it, the TimeoutError ends the
            # request in handle_one_request, which answers 408.
            body = self.rfile.read(length)
            if len(body) < length:
                raise _HTTPError(400, f"body ended after {len(body)} of {length} bytes")
            return body

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": "POST a batch to score; GET /health to probe"})

        def do_POST(self) -> None:  # noqa: N802
            try:
                got = (self.headers.get("Authorization") or "").encode()
                if expected is not None and not hmac.compare_digest(got, b"Bearer " + expected):
                    raise _HTTPError(401, "missing or wrong token (Authorization: Bearer ...)")
                body = self._read_body()
                try:
                    samples = split_requests(json.loads(body), bounds)
                except RecursionError:
                    raise _HTTPError(400, "bad request: JSON nested too deeply") from None
                except MediaTooLarge as e:
                    raise _HTTPError(413, f"media too large: {e}") from None
                except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
                    raise _HTTPError(400, f"bad request: {e}") from None
                try:
                    with lock:
                        out = reward_fn(samples)
                    prompts = [x.prompt for x in samples]
                    rewards = check_reward_output("server", out, len(samples), prompts).tolist()
                except Exception as e:  # noqa: BLE001 - reported to the client, server keeps serving
                    # The request's fault (no reference answer): 422, which clients do not retry.
                    code = 422 if _caused_by_input(e) else 500
                    raise _HTTPError(code, f"{type(e).__name__}: {e}") from None
            except _HTTPError as e:
                self._reply(e.args[0], {"error": e.args[1]})
                return
            self._reply(200, {"rewards": rewards})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if verbose:
                super().log_message(format, *args)

    return _BoundedServer((host, port), Handler, max_connections)


def load_reward_fn(
    verifier: str | None = None, component: str | None = None, kwargs: dict | None = None
) -> Callable[..., Any]:
    """The reward function to serve: a built-in verifier by name (a key of :data:`VERIFIERS`),
    or any dotted path; a class is instantiated with ``kwargs``, a plain function is served as
    is (with ``kwargs`` bound to it)."""
    import functools
    import importlib
    import inspect

    if (verifier is None) == (component is None):
        raise ValueError("give exactly one of verifier and component")
    if verifier is not None and verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; choose from {sorted(VERIFIERS)}")
    target = VERIFIERS[verifier] if verifier is not None else component
    module, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"component {target!r} cannot be imported: {e}") from None
    kwargs = kwargs or {}
    if inspect.isclass(obj):  # as a config builds it: a section argument from its mapping
        return instantiate_node({"_component_": target, **kwargs})
    return functools.partial(obj, **kwargs) if kwargs else obj


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightrft.rewards.server",
        description="Serve a LightRFT reward function over HTTP.",
        epilog="Requests may carry 'conversations' with media: an image part as "
        '{"type": "image", "image": "data:image/png;base64,..."}, a video part as its sampled '
        'frames {"type": "video", "video": ["data:image/png;base64,...", ...], "fps": 4.0} '
        "(fps optional). Each image and frame is bounded from its PNG header before decoding "
        "(--max-image-pixels, --max-request-pixels), a request's frames by --max-video-frames; "
        "audio parts are refused (400).",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--verifier", choices=sorted(VERIFIERS), help="a built-in verifier")
    which.add_argument("--component", help="dotted path of any reward function or its class")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments for it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=f"require 'Authorization: Bearer TOKEN' (default: ${TOKEN_ENV}, unset: no auth)",
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="larger bodies: 413")
    parser.add_argument("--read-timeout", type=float, default=30.0, help="seconds; then 408")
    parser.add_argument("--max-connections", type=int, default=32, help="more: 503")
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="pixels of one image or video frame (from its PNG header); more: 413 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-pixels",
        type=int,
        default=MAX_REQUEST_PIXELS,
        help="pixels of all images and video frames of a request; more: 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-video-frames",
        type=int,
        default=MAX_VIDEO_FRAMES,
        help="video frames of a request, all its videos together (each frame also counts "
        "against the pixel limits); more: 413 (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        parser.error(f"--kwargs is not valid JSON: {e}")
    if not isinstance(kwargs, dict):
        parser.error('--kwargs must be a JSON object, e.g. \'{"path": "/models/rm"}\'')
    try:
        reward_fn = load_reward_fn(args.verifier, args.component, kwargs)
    except (ValueError, TypeError) as e:  # TypeError: --kwargs the component does not take
        parser.error(str(e))
    try:
        server = make_server(
            reward_fn,
            args.host,
            args.port,
            verbose=args.verbose,
            token=args.token,
            max_body_bytes=int(args.max_body_mb * 2**20),
            read_timeout=args.read_timeout,
            max_connections=args.max_connections,
            max_image_pixels=args.max_image_pixels,
            max_request_pixels=args.max_request_pixels,
            max_video_frames=args.max_video_frames,
        )
    except ValueError as e:
        parser.error(str(e))
    host, port = server.server_address[:2]
    print(f"serving {args.verifier or args.component} on http://{host}:{port}", flush=True)
    if args.token:
        print("requests must carry 'Authorization: Bearer <token>'", flush=True)
    with server, suppress(KeyboardInterrupt):  # closed on the way out
        server.serve_forever()


if __name__ == "__main__":
    main()
