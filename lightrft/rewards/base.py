"""The reward-function interface, output validation, and weighted per-label combination.

A reward function is any callable

    fn(samples: Sequence[Sample]) -> Sequence[float] | torch.Tensor   # [B]

that scores a batch of :class:`Sample` s, one reward per sample. A sample is one record: its
``prompt`` (a string, or chat messages), its ``response`` text and token ids, its ``reference``
answer (``None`` where it has none), its task ``label`` such as ``"math"`` (``None`` where
unlabelled), its ``conversation`` (the prompt as the chat it was rendered from, media inline: an
image part holds its image under ``"image"``; ``None`` for a prompt rendered without a chat
template) and its ``media``. Scoring whole batches at once lets a reward model batch. Optional
attributes:

- ``requires_reference = True``: every sample it scores must have a reference; a missing one is
  reported with the sample's index and prompt before the function runs.
- ``name``: the default name under which :func:`build_reward` logs it.

A function written for the interface before samples (``fn(prompts, responses, references,
labels)``: five parallel lists) is refused when the reward is built, naming it and the change
(:func:`check_signature`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightrft.config import UserError, instantiate
from lightrft.data.media import MEDIA_KINDS, Media

# A prompt is its text, or a chat conversation [{"role": ..., "content": ...}, ...].
Prompt = str | Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Sample:
    """One sample at the reward boundary: what every reward function, reward model, judge and
    remote reward reads (see the module docstring)."""

    prompt: Prompt
    response: str
    response_ids: Sequence[int] | None = None
    reference: str | None = None
    label: str | None = None
    conversation: list[dict[str, Any]] | None = None
    media: Media | None = None

    @staticmethod
    def batch(
        prompts: Sequence[Prompt],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
        conversations: Sequence[list[dict[str, Any]] | None] | None = None,
    ) -> list[Sample]:
        """Samples from parallel lists (the remote wire format's, a recipe's rollout columns);
        a list not given is None for every sample; lists of different lengths are refused
        (:class:`RewardInputError`, naming the list)."""
        n = len(responses)
        given = dict(prompts=prompts, references=references, labels=labels)
        for arg, seq in {**given, "conversations": conversations}.items():
            if seq is not None and len(seq) != n:
                raise RewardInputError(f"{arg} has {len(seq)} entries but responses has {n}")
        none = [None] * n
        return [
            Sample(p, r, reference=ref, label=lab, conversation=conv)
            for p, r, ref, lab, conv in zip(
                prompts,
                responses,
                references or none,
                labels or none,
                conversations or none,
                strict=True,
            )
        ]


class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


class RewardInputError(ValueError):
    """The batch handed to a reward function cannot be scored as given (a sample without its
    reference answer, lists of different lengths, a label routed nowhere): the caller's mistake,
    not the function's. A reward server answers it with HTTP 422, not 500."""


def prompt_preview(prompt: Prompt, width: int = 40) -> str:
    """The start of a prompt (the last message's content for a conversation), quoted."""
    if not isinstance(prompt, str):
        prompt = str(prompt[-1].get("content", "")) if prompt else ""
    text = " ".join(prompt.split())
    return repr(text if len(text) <= width else text[:width] + "...")


def media_parts(conversation: Prompt) -> list[dict[str, Any]]:
    """The image, video and audio parts of a conversation, in order (none for a string)."""
    if isinstance(conversation, str):
        return []
    return [
        dict(part)
        for m in conversation
        if not isinstance(m["content"], str)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in MEDIA_KINDS
    ]


def check_reward_output(
    name: str,
    out: Any,
    n: int,
    prompts: Sequence[Prompt] | None = None,
    index: Sequence[int] | None = None,
) -> torch.Tensor:
    """``out`` as a float32 CPU tensor [n], or :class:`RewardError` naming the function ``name``.

    Accepts a 1-D tensor or array or a list of real numbers of length ``n``; a scalar is rejected
    rather than broadcast, and a NaN or infinite value is reported with its sample (``index`` maps
    positions in ``out`` to batch indices, ``prompts`` are the scored prompts, for the message).
    """

    def refused(what: str) -> RewardError:
        return RewardError(f"reward function {name!r} returned {what}")

    if isinstance(out, torch.Tensor):
        if out.dim() != 1:
            raise refused(
                f"a tensor of shape {tuple(out.shape)}; expected one reward per sample, shape ({n},)"
            )
        if out.dtype.is_complex:
            raise refused(f"a {out.dtype} tensor")
        values = out.detach().to("cpu", torch.float32)
    elif (
        isinstance(out, (str, bytes, Mapping))
        or not isinstance(out, Sequence)
        and not hasattr(out, "__array__")
    ):
        raise refused(
            f"{type(out).__name__}; expected a list or 1-D tensor of {n} rewards (a single value "
            "is not broadcast)"
        )
    else:
        items = out.tolist() if hasattr(out, "tolist") else list(out)
        if not isinstance(items, list):  # a 0-d array
            raise refused(f"a scalar; expected {n} rewards (a single value is not broadcast)")
        if any(isinstance(v, (list, tuple)) for v in items):
            raise refused(f"nested lists; expected {n} numbers")
        bad = [i for i, v in enumerate(items) if not _is_real(v)]
        if bad:
            raise refused(f"a non-number at position {bad[0]}: {items[bad[0]]!r}")
        values = torch.tensor([float(v) for v in items], dtype=torch.float32)
    if values.numel() != n:
        raise refused(f"{values.numel()} rewards for {n} samples")
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        pos = int((~finite).nonzero()[0])
        i = index[pos] if index is not None else pos
        where = f"sample {i}"
        if prompts is not None:
            where += f" (prompt {prompt_preview(prompts[pos])})"
        raise refused(
            f"a non-finite reward ({values[pos].item()}) for {where}; "
            f"{int((~finite).sum())} of {n} rewards are NaN or infinite"
        )
    return values


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number, not a bool (an integer of 400 digits is none:
    it overflows a float, and is refused like any other bad value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_real(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.dtype.is_complex
    return isinstance(v, numbers.Real)


@dataclass
class RewardOutput:
    """Rewards of one batch of B samples.

    ``total`` is the weighted sum per sample. ``parts[name]`` holds function ``name``'s unweighted
    rewards, 0 where it did not score the sample; ``applied[name]`` says where it did.
    """

    total: torch.Tensor  # [B] float32
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B] float32
    applied: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B] bool
    seconds: dict[str, float] = field(default_factory=dict)  # name -> wall time of its call
    # "name/head" -> [B] float32: every head of a multi-head reward model (its
    # ``last_head_scores``), 0 where the function did not score the sample; not in ``total``.
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    # "name/key" -> value: a function's own metrics of this call (its ``last_metrics``), e.g. a
    # judge's parse failures.
    extra: dict[str, float] = field(default_factory=dict)

    def check_finite(self, prompts: Sequence[Prompt], wheres: Sequence[str | None]) -> None:
        """Raise naming the first sample whose total is not finite (each function's rewards
        are checked where it is called; this catches the weights and the sum)."""
        bad = (~torch.isfinite(self.total)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"non-finite total reward {self.total[bad[0]].item()} for sample "
                f"{bad[0]} (prompt {prompts[bad[0]][:60]!r}, from {wheres[bad[0]]})"
            )

    def as_float64(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(total, parts, applied)``: the float32 rewards widened to float64 tensors (each
        function's floats were rounded to float32 when checked), and the bool masks."""
        parts = {n: p.double() for n, p in self.parts.items()}
        return self.total.double(), parts, {n: a.clone() for n, a in self.applied.items()}

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Mean and std of the total and of each function over the samples it scored, and the
        seconds each function took: ``{prefix}/total/mean``, ``{prefix}/{name}/std``, ..."""
        out = {
            f"{prefix}/total/mean": self.total.mean().item() if self.total.numel() else 0.0,
            f"{prefix}/total/std": _std(self.total),
        }
        # Each function's rewards, then each head's scores ("name/head"), where it scored.
        for key, scores in {**self.parts, **self.heads}.items():
            vals = scores[self.applied[key.split("/")[0]]]
            if vals.numel():
                out[f"{prefix}/{key}/mean"] = vals.mean().item()
                out[f"{prefix}/{key}/std"] = _std(vals)
            if key in self.parts:
                out[f"{prefix}/{key}/count"] = float(vals.numel())
                out[f"{prefix}/{key}/seconds"] = self.seconds.get(key, 0.0)
        out.update({f"{prefix}/{key}": v for key, v in self.extra.items()})
        return out


def _std(x: torch.Tensor) -> float:
    return x.std(unbiased=False).item() if x.numel() > 1 else 0.0


def instantiate_node(node: Mapping[str, Any]) -> Any:
    """Build the component a ``_component_`` mapping (a dict or a config node) describes."""
    # A DictConfig keeps its parent, so `${...}` interpolations into the rest of the config work.
    return instantiate(node if isinstance(node, DictConfig) else OmegaConf.create(dict(node)))


def _default_name(fn: Any) -> str:
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    raw = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"(?<!^)(?=[A-Z])", "_", raw).lower()


class CombinedReward:
    """Several named reward functions, weighted, each applied to the samples whose label routes
    to it.

    Args:
        functions: name -> reward function, or a ``{"_component_": ..., **kwargs}`` mapping that
            is instantiated (so YAML can nest them).
        weights: name -> weight of its reward in the total (default 1.0 for each).
        routes: label -> names of the functions that score samples with that label. The key
            ``"*"`` lists the functions for labels that have no entry. ``None``: every function
            scores every sample, whatever its label.
        default_reward: total reward of a sample whose label has no route (and no ``"*"``);
            ``None`` (the default) makes such a sample an error, so a typo in a label cannot
            silently zero its rewards.

    Calling it returns a :class:`RewardOutput`. Each function is called once per batch, on the
    samples routed to it, with keyword arguments.
    """

    def __init__(
        self,
        functions: dict[str, Any],
        weights: dict[str, float] | None = None,
        routes: dict[str, list[str]] | None = None,
        default_reward: float | None = None,
    ) -> None:
        if not isinstance(functions, Mapping) or not functions:
            raise ValueError("functions must be a non-empty mapping of name -> reward function")
        self.functions: dict[str, Callable[..., Any]] = {}
        for name, fn in functions.items():
            if name == "total" or "/" in str(name):
                raise ValueError(f"functions: {name!r} is not a usable name (reserved or has '/')")
            if isinstance(fn, Mapping):
                if "_component_" not in fn:
                    raise ValueError(f"functions.{name} must be a callable or have a _component_")
                fn = instantiate_node(fn)
            if not callable(fn):
                raise ValueError(f"functions.{name} is a {type(fn).__name__}, not callable")
            check_signature(f"functions.{name}", fn)
            self.functions[str(name)] = fn
        self.weights = {name: 1.0 for name in self.functions}
        self.weights.update(_checked_weights(weights or {}, list(self.functions)))
        self.routes = None if routes is None else _checked_routes(routes, list(self.functions))
        if default_reward is not None and not math.isfinite(default_reward):
            raise ValueError(f"default_reward must be finite, got {default_reward!r}")
        self.default_reward = default_reward

    @property
    def collective(self) -> bool:
        """Whether a call is a collective every rank must make, also with no samples: true when
        one of the functions is (a reward model sharded over the ranks)."""
        return any(getattr(fn, "collective", False) for fn in self.functions.values())

    def route(self, label: str | None) -> list[str] | None:
        """Names of the functions that score a sample with ``label``; ``None`` if unrouted."""
        if self.routes is None:
            return list(self.functions)
        return self.routes.get(label, self.routes.get("*"))  # keys are strings: None has none

    def __call__(self, samples: Sequence[Sample]) -> RewardOutput:
        """Every function's rewards of the samples routed to it, weighted and summed."""
        n = len(samples)
        total = torch.zeros(n, dtype=torch.float32)  # [B]
        members: dict[str, list[int]] = {name: [] for name in self.functions}
        for i, s in enumerate(samples):
            names = self.route(s.label)
            if names is None:
                if self.default_reward is None:
                    raise RewardInputError(
                        f"sample {i} (prompt {prompt_preview(s.prompt)}) has label {s.label!r}, "
                        f"which routes to no reward function (routes: {sorted(self.routes or {})})"
                        "; add it to routes, add a '*' route, or set default_reward"
                    )
                total[i] = self.default_reward
            for name in names or []:
                members[name].append(i)
        out = RewardOutput(total=total)
        for name, fn in self.functions.items():
            idx = members[name]
            part = torch.zeros(n, dtype=torch.float32)  # [B]
            mask = torch.zeros(n, dtype=torch.bool)  # [B]
            # A collective function (a sharded reward model) is called on every rank, also
            # with no samples of its own: the others' forwards need this rank.
            if idx or getattr(fn, "collective", False):
                start = time.perf_counter()
                vals = self._call_one(name, fn, idx, [samples[i] for i in idx])
                out.seconds[name] = time.perf_counter() - start
                part[idx] = vals
                mask[idx] = True
                total += self.weights[name] * part
                for key, value in (getattr(fn, "last_metrics", None) or {}).items():
                    out.extra[f"{name}/{key}"] = float(value)
                heads = getattr(fn, "last_head_scores", None) or {}
                for head, scores in heads.items() if len(heads) > 1 else ():
                    if len(scores) == len(idx):  # scores of this very call
                        head_scores = torch.zeros(n)  # [B]
                        head_scores[idx] = torch.as_tensor(scores, dtype=torch.float32)
                        out.heads[f"{name}/{head}"] = head_scores
            out.parts[name] = part
            out.applied[name] = mask
        return out

    @staticmethod
    def _call_one(name, fn, idx: list[int], samples: list[Sample]) -> torch.Tensor:
        if getattr(fn, "requires_reference", False):
            for i, s in zip(idx, samples, strict=True):
                ref = s.reference
                if ref is None or (isinstance(ref, str) and not ref.strip()):
                    raise RewardInputError(
                        f"reward function {name!r} needs a reference answer, but sample {i} "
                        f"(label {s.label!r}, prompt {prompt_preview(s.prompt)}) has none"
                    )
        try:
            out = fn(samples)
        except Exception as e:
            raise RewardError(
                f"reward function {name!r} ({type(fn).__name__}) failed on a batch of {len(idx)} "
                f"samples: {type(e).__name__}: {e}"
            ) from e
        return check_reward_output(name, out, len(idx), [s.prompt for s in samples], idx)


def check_signature(name: str, fn: Callable[..., Any]) -> None:
    """Refuse a reward function written for the parallel-list interface (parameters
    ``prompts, responses, references, labels``), naming it and saying how to port it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    if "responses" in params and "samples" not in params:
        raise ValueError(
            f"reward function {name!r} takes (prompts, responses, references, labels): reward "
            "functions now take one list of lightrft.rewards.Sample; write it as "
            "`def fn(samples): return [... s.prompt, s.response, s.reference, s.label ...]` "
            "(docs/reward_models.md#custom-reward-functions)"
        )


def reward_names(node: Any, key: str = "reward") -> list[str]:
    """The names of a reward config's functions (a :class:`CombinedReward` 's ``functions``;
    ``[]`` for a single reward function), after refusing, before anything is built, a
    ``weights`` or ``routes`` entry that names no function (``ValueError`` naming the key)."""
    functions = node.get("functions") if isinstance(node, Mapping) else None
    if not isinstance(functions, Mapping):
        return []
    names = [str(n) for n in functions]
    _checked_weights(node.get("weights") or {}, names, f"{key}.")
    _checked_routes(node.get("routes") or {}, names, f"{key}.")
    return names


def _checked_weights(weights: Mapping[str, Any], names: list[str], key: str = "") -> dict:
    """``weights`` as floats, after refusing one that names no function in ``names`` or is not a
    finite number (``ValueError`` naming ``{key}weights.<name>``)."""
    for name, w in weights.items():
        if name not in names:
            raise ValueError(
                f"{key}weights.{name}: no reward function named {name!r}; "
                f"functions are {sorted(names)}"
            )
        if not finite_number(w):
            raise ValueError(f"{key}weights.{name} must be a finite number, got {w!r}")
    return {name: float(w) for name, w in weights.items()}


def _checked_routes(routes: Mapping[str, Any], names: list[str], key: str = "") -> dict:
    """``routes`` as label -> list of names (a single name is a list of one), after refusing a
    name not in ``names`` (``ValueError`` naming ``{key}routes.<label>``)."""
    out: dict[str, list[str]] = {}
    for label, route in routes.items():
        route = [route] if isinstance(route, str) else list(route or [])
        unknown = [n for n in route if n not in names]
        if unknown:
            raise ValueError(
                f"{key}routes.{label}: no reward function named {unknown[0]!r}; "
                f"functions are {sorted(names)}"
            )
        out[str(label)] = route
    return out


def build_reward(spec: Any, name: str | None = None) -> CombinedReward:
    """A :class:`CombinedReward` from a config node or a reward function.

    ``spec`` is a ``CombinedReward`` (returned as is), a ``_component_`` mapping (instantiated),
    or any reward function, which is wrapped as the only function under ``name`` (default: its
    ``name`` attribute or its class / function name in snake case), so recipes always get a
    :class:`RewardOutput`.
    """
    if isinstance(spec, Mapping):
        if "_component_" not in spec:
            raise ValueError("a reward config needs a _component_ key")
        spec = instantiate_node(spec)
    if isinstance(spec, CombinedReward):
        return spec
    if not callable(spec):
        raise ValueError(f"a reward must be callable, got {type(spec).__name__}")
    return CombinedReward({name or _default_name(spec): spec})
