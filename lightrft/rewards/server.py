"""A small reference reward server: any LightRFT reward function behind HTTP (``http.server``).

    python -m lightrft.rewards.server --port 8000 --verifier math
    python -m lightrft.rewards.server --port 8000 \\
        --component lightrft.rewards.RewardModel --kwargs '{"path": "/models/rm", "device": "cuda"}'

It answers POST requests on any path with the protocol of :mod:`lightrft.rewards.remote`, and
``GET /health`` with ``{"status": "ok"}``. Requests are scored one at a time (a lock), since a
reward model on one device gains nothing from overlapping calls. Bad requests get HTTP 400 and
a failing reward function HTTP 500, each with ``{"error": message}``.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightrft.rewards.base import check_reward_output

__all__ = ["VERIFIERS", "load_reward_fn", "main", "make_server", "split_requests"]

VERIFIERS = {
    "math": "lightrft.rewards.MathVerifier",
    "gsm8k": "lightrft.rewards.GSM8KVerifier",
    "format": "lightrft.rewards.ThinkFormatReward",
    "code": "lightrft.rewards.CodeVerifier",
}


def split_requests(data: Any) -> dict[str, list]:
    """The reward-function arguments of a request body, or ``ValueError`` saying what is wrong.

    ``responses`` is used if present; otherwise each response is its query with the prompt
    removed from the front (or the last message's content, for a conversation query).
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
        if val is None:
            val = [None] * n if key in ("references", "labels") else val
        elif not isinstance(val, list) or len(val) != n:
            raise ValueError(f"'{key}' must be a list of {n} entries")
        args[key] = val
    prompts = args["prompts"] or [""] * n
    if responses is None:
        if not all(isinstance(q, (str, list)) for q in queries):
            raise ValueError("'queries' must hold strings or message lists")
        responses = []
        for q, p in zip(queries, prompts, strict=True):
            if isinstance(q, list):  # a conversation: the response is the last message
                responses.append(str(q[-1].get("content", "")) if q else "")
            elif isinstance(p, str) and q.startswith(p):
                responses.append(q[len(p) :])
            else:
                responses.append(q)
    if not all(isinstance(r, str) for r in responses):
        raise ValueError("'responses' must hold strings")
    return {
        "prompts": prompts,
        "responses": responses,
        "references": args["references"],
        "labels": args["labels"],
    }


def make_server(
    reward_fn: Callable[..., Any], host: str = "127.0.0.1", port: int = 0, verbose: bool = False
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) that scores requests with ``reward_fn``.

    ``port=0`` picks a free port: read it from ``server.server_address[1]``. Run it with
    ``server.serve_forever()`` (e.g. in a thread) and stop it with ``server.shutdown()``.
    """
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": "POST a batch to score; GET /health to probe"})

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
                kwargs = split_requests(json.loads(self.rfile.read(length)))
            except (ValueError, UnicodeDecodeError) as e:
                self._reply(400, {"error": f"bad request: {e}"})
                return
            n = len(kwargs["responses"])
            try:
                with lock:
                    out = reward_fn(**kwargs)
                rewards = check_reward_output("server", out, n, kwargs["prompts"]).tolist()
            except Exception as e:  # noqa: BLE001 - reported to the client, server keeps serving
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})
                return
            self._reply(200, {"rewards": rewards})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if verbose:
                super().log_message(format, *args)

    return ThreadingHTTPServer((host, port), Handler)


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
    if inspect.isclass(obj):
        return obj(**kwargs)
    return functools.partial(obj, **kwargs) if kwargs else obj


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightrft.rewards.server",
        description="Serve a LightRFT reward function over HTTP.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--verifier", choices=sorted(VERIFIERS), help="a built-in verifier")
    which.add_argument("--component", help="dotted path of any reward function or its class")
    parser.add_argument("--kwargs", default="{}", help="JSON keyword arguments for it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
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
    server = make_server(reward_fn, args.host, args.port, verbose=args.verbose)
    host, port = server.server_address[:2]
    print(f"serving {args.verifier or args.component} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
