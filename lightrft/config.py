"""YAML configs: ``tune run``-style parsing and ``_component_`` instantiation, checked strictly,
read into typed sections.

A recipe declares its config as :class:`Section` s: frozen dataclasses that are their own schema
(:func:`section`, :func:`option`), composed into one class per recipe from the library's shared
sections (``lightrft.sections``, ``lightrft.training.run``) and its own. It exposes
``CONFIG_SCHEMA = MyConfig.schema()`` and ``build_options = MyConfig.read`` and decorates its
entry point with :func:`parse`. Before any model loads, every key of the YAML and of the
``key=value`` overrides is checked against the schema, every ``_component_`` is imported and its
keyword arguments bound to its signature, then the sections are read (defaults, bounds, rules
across keys). A misspelled key, a wrong-typed value or a broken rule fails with the file and line
(or the override) and, for a key, the closest valid names.

The schema a section produces is plain Python::

    {
        "output_dir": str,                       # required
        "seed": int | None,                      # may be absent or null
        "optimizer": Component,                  # a mapping with `_component_`
        "prepare": list[Component] | None,
        "model": {"path": str, "dtype": Literal["float32", "bf16"] | None},   # nested keys
        "metrics": {"tensorboard": bool | None},  # all members optional: may be absent or null
        "extra": dict,                           # free-form mapping, not checked
    }
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import io
import itertools
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf


class Component:
    """Schema marker: a mapping with a ``_component_`` dotted path and its keyword arguments."""


@dataclass(frozen=True)
class Bound:
    """A lower bound on a component's argument, checked by ``lightrft validate`` (and ``run``)
    before anything is built: ``max_length: Annotated[int | None, Bound(ge=2)] = None``. The
    component checks the same bound when called from Python with :func:`check_args`."""

    ge: float | None = None
    gt: float | None = None

    def check(self, key: str, value: Any) -> None:
        """``value`` (None or a bool: unchecked) within the bound, else a ``ValueError``."""
        if value is None or isinstance(value, bool):
            return
        if self.ge is not None:
            at_least(key, value, self.ge)
        if self.gt is not None:
            at_least(key, value, self.gt, strict=True)


class UserError(Exception):
    """A mistake in what the user gave (config, data, output directory, checkpoint, rewards): a
    recipe run prints it as one clean line and exits 2 (``LIGHTRFT_TRACEBACK=1`` shows the
    traceback); anything else is an internal error and keeps its traceback."""


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message lists every problem found, each with its place."""


@dataclass
class Source:
    """Where config keys came from, to point errors at a file line or an override."""

    path: str | None = None
    lines: dict[str, int] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)

    def where(self, key: str) -> str:
        if key in self.overrides:
            return f"override '{self.overrides[key]}'"
        if self.path is not None:
            # A key inherited from a parent mapping points at the parent's line.
            probe = key
            while probe and probe not in self.lines:
                probe = probe.rpartition(".")[0]
            line = self.lines.get(probe)
            return f"{self.path}:{line}" if line else self.path
        return "config"


# --------------------------------------------------------------------------- loading


# A config is a few hundred values; these bounds refuse hostile files (YAML aliases that expand
# exponentially, nesting that overflows a parser's recursion, integers too long for ``int``)
# within milliseconds, before anything walks or builds them.
MAX_VALUES = 100_000  # values once aliases (&a / *a) are expanded
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_INT_DIGITS = 100


def _read(path: str) -> str:
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the config as UTF-8"
        ) from None


def _compose(text: str, where: str) -> dict[str, int]:
    """The dotted key paths of ``text``'s YAML and their 1-based lines, its node graph refused
    by name when it breaks a bound above.

    Each distinct node is walked once (aliases share nodes), so this is linear in the text even
    where the expanded config would be exponential; the keys under an alias used twice are
    mapped at its first use (elsewhere :meth:`Source.where` reads the alias's own line). An
    alias inside the node it names (``a: &a [1, *a]``) would expand forever: refused."""
    lines: dict[str, int] = {}
    seen: dict[int, tuple[int, int]] = {}  # id(node) -> (values under it, aliases expanded; height)
    inside: set[int] = set()  # the nodes the walk is in (their children not done)

    def walk(node: yaml.Node, prefix: str) -> tuple[int, int]:
        line = node.start_mark.line + 1
        if id(node) in inside:
            raise ConfigError(
                f"{where}:{line}: an alias (*name) inside the node it names: its value would "
                "never end"
            )
        if id(node) in seen:
            return seen[id(node)]
        if isinstance(node, yaml.ScalarNode):
            if node.tag.endswith(":int") and len(node.value.lstrip("+-")) > MAX_INT_DIGITS:
                raise ConfigError(
                    f"{where}:{line}: an integer of {len(node.value)} digits "
                    f"(at most {MAX_INT_DIGITS})"
                )
            return seen.setdefault(id(node), (1, 0))
        inside.add(id(node))
        sizes = []
        for i, item in enumerate(node.value):
            key, value = item if node.id == "mapping" else (None, item)
            name = str(i) if key is None else key.value
            if key is not None:
                sizes.append(walk(key, prefix))
            if isinstance(name, str):  # (a list or mapping as a key: the loader refuses it)
                lines[prefix + name] = (key or value).start_mark.line + 1
            sizes.append(walk(value, f"{prefix}{name}."))
        inside.discard(id(node))
        size, height = 1 + sum(n for n, _ in sizes), 1 + max((h for _, h in sizes), default=0)
        if height > MAX_DEPTH:
            raise ConfigError(f"{where}:{line}: nested {height} levels deep (at most {MAX_DEPTH})")
        if size > MAX_VALUES:
            raise ConfigError(
                f"{where}:{line}: holds more than {MAX_VALUES:,} values once its aliases (*name) "
                "are expanded; write the values out or use fewer aliases"
            )
        return seen.setdefault(id(node), (size, height))

    try:
        root = yaml.compose(text)
        if root is not None:
            walk(root, "")
    except RecursionError:  # the parser's, or the walk's on what it read
        raise ConfigError(
            f"{where}: nested deeper than YAML can read (at most {MAX_DEPTH} levels)"
        ) from None
    return lines


def _check_override(arg: str) -> None:
    """An override's key and value within the bounds a file keeps (checked before parsing)."""
    key, _, value = arg.lstrip("~").partition("=")
    if key.count(".") >= MAX_DEPTH:
        raise ConfigError(
            f"override '{arg[:80]}...': the key is nested deeper than {MAX_DEPTH} levels"
        )
    deepest = max(itertools.accumulate(((c in "[{") - (c in "]}") for c in value), initial=0))
    if deepest > MAX_DEPTH:
        raise ConfigError(
            f"override of {key}: the value is nested {deepest} levels deep (at most {MAX_DEPTH})"
        )
    try:
        _compose(value, f"override of {key}")
    except yaml.YAMLError:
        return  # reported with the override's name by _set


def _set(cfg: DictConfig, data: dict, arg: str) -> None:
    """Apply one ``key=value`` override to ``cfg``, ``tune run``'s rules: the value is YAML as
    OmegaConf reads it (``1e-5`` is a float; ``None`` is null too), a list index is a key
    (``prepare.0.out_dir=...``), and a top-level key whose value is a ``_component_`` section
    swaps the component (``optimizer=torch.optim.SGD`` sets ``optimizer._component_``) unless
    the value is null (``eval_dataset=null`` drops the whole section)."""
    key, value = arg.split("=", 1)
    value = "null" if value.strip() == "None" else value
    node = data.get(key)
    if isinstance(node, dict) and "_component_" in node:
        if value.strip() not in ("null", "Null", "NULL", "~"):
            key += "._component_"
    try:
        cfg.merge_with_dotlist([f"{key}={value}"])
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"override '{arg}': the value of {key} is not valid YAML ({problem}); "
            "write a list as [0.9, 0.99] and quote a string that holds [ ] { } : #"
        ) from None
    except (ValueError, TypeError, KeyError, IndexError) as e:  # OmegaConf's refusals
        raise ConfigError(f"override '{arg}': {e}") from None


def load(
    path: str | Path, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[DictConfig, Source]:
    """Load a YAML config and apply ``tune run``-style overrides (``a.b=1``, ``~a.b``).

    Returns the merged config and a :class:`Source` for error messages.
    """
    path = str(path)
    if not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    text = _read(path)
    try:
        lines = _compose(text, path)
        raw = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    src = Source(path=path, lines=lines)
    data = OmegaConf.to_container(raw, resolve=False)
    for arg in overrides:  # removals first, then the values set
        if arg.startswith("--"):
            raise ConfigError(f"unexpected flag {arg!r}: overrides are key=value or ~key")
        if not arg.startswith("~") and "=" not in arg:
            raise ConfigError(f"override {arg!r} must be key=value (or ~key to remove a key)")
        _check_override(arg)
        key = arg.lstrip("~").split("=", 1)[0]
        src.overrides[key] = arg
        if arg.startswith("~"):
            _remove(data, arg[1:].split("=", 1)[0], path)
    cfg = OmegaConf.create(data)
    for arg in overrides:
        if not arg.startswith("~"):
            _set(cfg, data, arg)
    return cfg, src


def _remove(data: dict, dotpath: str, path: str) -> None:
    node, keys = data, dotpath.split(".")
    for i, k in enumerate(keys):
        if isinstance(node, list) and k.isdigit() and int(k) < len(node):
            k = int(k)
        elif not isinstance(node, dict) or k not in node:
            raise ConfigError(f"~{dotpath}: {path} has no key '{'.'.join(keys[: i + 1])}'")
        if i == len(keys) - 1:
            del node[k]
        else:
            node = node[k]


# --------------------------------------------------------------------------- checking


def resolve(dotted: str) -> Any:
    """The object a dotted path names (``torch.optim.AdamW``), as ``_component_`` resolves it:
    the longest importable module prefix, then attributes. A path that names nothing raises
    :class:`ConfigError` saying which part is missing."""
    parts = dotted.split(".")
    if not dotted or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"'{dotted}' is not a dotted import path (e.g. torch.optim.AdamW)")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError as e:
        raise ConfigError(f"cannot load '{dotted}': {e!r}; is '{parts[0]}' installed?") from None
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if not isinstance(obj, types.ModuleType):
            raise ConfigError(f"cannot load '{dotted}': {'.'.join(parts[:i])} has no '{part}'")
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ModuleNotFoundError as e:
            if e.name != ".".join(parts[: i + 1]):
                raise  # the module exists and failed importing something of its own
            raise ConfigError(
                f"cannot load '{dotted}': '{part}' is neither an attribute nor a submodule of "
                f"'{'.'.join(parts[:i])}'"
            ) from None
    return obj


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
    if _is_union(t):
        return " or ".join(_type_name(a) for a in typing.get_args(t) if a is not type(None))
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


_SCALARS = {type(None): type(None), bool: bool, int: int, float: (int, float), str: str}


def _matches(value: Any, t: Any) -> bool:
    """Whether a (YAML / override) value fits a simple annotation; unknown annotations pass."""
    if t is Any or t is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(t)
    if _is_union(t):
        return any(_matches(value, a) for a in typing.get_args(t))
    if origin is Literal:
        return value in typing.get_args(t)
    if t in _SCALARS:  # a bool is no int or float here (YAML's true is not 1)
        return isinstance(value, _SCALARS[t]) and (t is bool or not isinstance(value, bool))
    if t in (list, tuple) or origin in (list, tuple, typing.Sequence):
        return isinstance(value, (list, tuple, ListConfig))
    if t is dict or origin is dict:
        return isinstance(value, (dict, DictConfig))
    # Tensors, dtypes, callables, classes...: a YAML scalar cannot be checked against them.
    return not isinstance(value, str) or isinstance(t, type) and issubclass(t, str)


def _closest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _check_component(node: Any, key: str, src: Source, errors: list[str]) -> None:
    if not isinstance(node, (dict, DictConfig)) or "_component_" not in node:
        errors.append(f"{src.where(key)}: '{key}' must be a mapping with a '_component_' key")
        return
    target = node["_component_"]
    try:
        obj = resolve(str(target))
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path being wrong
        errors.append(
            f"{src.where(key + '._component_')}: '{key}._component_: {target}' "
            f"cannot be imported ({type(e).__name__}: {e})"
        )
        return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        hints = typing.get_type_hints(fn)
        extras = typing.get_type_hints(fn, include_extras=True)  # with Annotated bounds
    except Exception:  # noqa: BLE001 - unresolvable forward references: fall back to defaults
        extras = hints = {}
    for arg, value in node.items():
        if arg == "_component_":
            continue
        sub = f"{key}.{arg}"
        if arg not in params:
            if not var_kw:
                named = [
                    n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                ]
                # A key that moved into a section argument names its new place.
                moved = [
                    f"; it moved to '{key}.{n}.{s.moved[arg]}'"
                    for n, s in _section_args(hints).items()
                    if arg in getattr(s, "moved", {})
                ]
                errors.append(
                    f"{src.where(sub)}: unknown key '{sub}': {target} takes no "
                    f"argument '{arg}'{moved[0] if moved else _closest(arg, named)}"
                )
            continue
        if isinstance(value, (dict, DictConfig)) and "_component_" in value:
            _check_component(value, sub, src, errors)
            continue
        # Components one level down (a mapping or a list of them, e.g. CombinedReward's
        # `functions: {name: {_component_: ...}}`) are checked like the rest of the config.
        items = value.items() if isinstance(value, (dict, DictConfig)) else []
        if isinstance(value, (list, ListConfig)):
            items = enumerate(value)
        nested = [
            (k, v) for k, v in items if isinstance(v, (dict, DictConfig)) and "_component_" in v
        ]
        for k, v in nested:
            _check_component(v, f"{sub}.{k}", src, errors)
        if nested:
            continue
        p = params[arg]
        t = hints.get(arg, p.annotation)
        if (sec := _section_type(t)) is not None and isinstance(value, (dict, DictConfig)):
            before = len(errors)
            _check(value, sec.schema(), sub, src, errors)
            if len(errors) == before:
                try:
                    sec.read(value, f"{sub}.")
                except ValueError as e:
                    errors.append(f"{src.where(sub)}: {e}")
            continue
        if t is inspect.Parameter.empty and p.default not in (inspect.Parameter.empty, None):
            t = type(p.default)
        if value is not None and not _matches(value, t):
            errors.append(f"{src.where(sub)}: '{sub}' expects {_type_name(t)}, got {value!r}")
            continue
        for bound in _bounds(extras.get(arg)):
            try:
                bound.check(sub, value)
            except ValueError as e:
                errors.append(f"{src.where(sub)}: {e}")


def check_args(fn: Callable[..., Any], **args: Any) -> None:
    """``args`` (name=value) against the :class:`Bound` s annotated on ``fn``'s parameters:
    the check ``lightrft validate`` runs on a config, for a component called from Python."""
    hints = typing.get_type_hints(fn, include_extras=True)
    for name, value in args.items():
        for bound in _bounds(hints.get(name)):
            bound.check(name, value)


def _bounds(t: Any) -> list[Bound]:
    """The :class:`Bound` s annotated on a parameter type (inside ``X | None`` too)."""
    if typing.get_origin(t) is typing.Annotated:
        return [m for m in t.__metadata__ if isinstance(m, Bound)] + _bounds(typing.get_args(t)[0])
    if _is_union(t):
        return [b for a in typing.get_args(t) for b in _bounds(a)]
    return []


def _check(cfg: Any, schema: Any, key: str, src: Source, errors: list[str]) -> None:
    if isinstance(schema, Mapping):
        if cfg is None and _optional(schema):
            return
        if not isinstance(cfg, (dict, DictConfig)):
            errors.append(f"{src.where(key)}: '{key}' must be a mapping")
            return
        prefix = f"{key}." if key else ""
        for k in cfg:
            if k not in schema:
                errors.append(
                    f"{src.where(prefix + str(k))}: unknown key '{prefix}{k}'"
                    f"{_closest(str(k), list(schema))}"
                )
        for k, sub in schema.items():
            if k in cfg:
                _check(cfg[k], sub, prefix + k, src, errors)
            elif not _optional(sub):
                errors.append(
                    f"{src.where(key) if key else src.path or 'config'}: "
                    f"missing required key '{prefix}{k}'"
                )
        return
    if cfg is None:
        if not _optional(schema):
            errors.append(f"{src.where(key)}: '{key}' must not be null")
        return
    origin, args = typing.get_origin(schema), typing.get_args(schema)
    inner = [a for a in args if a is not type(None)]
    if _is_union(schema) and len(inner) == 1:  # X | None, not null: X (a union: _matches below)
        _check(cfg, inner[0], key, src, errors)
    elif schema is Component:
        _check_component(cfg, key, src, errors)
    elif origin is list:
        if not isinstance(cfg, (list, ListConfig)):
            errors.append(f"{src.where(key)}: '{key}' must be a list")
            return
        for i, item in enumerate(cfg):
            _check(item, args[0] if args else Any, f"{key}.{i}", src, errors)
    elif schema is dict:
        if not isinstance(cfg, (dict, DictConfig)):
            errors.append(f"{src.where(key)}: '{key}' must be a mapping")
    elif not _matches(cfg, schema):
        errors.append(f"{src.where(key)}: '{key}' expects {_type_name(schema)}, got {cfg!r}")


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) in (Union, types.UnionType)


class _OptionalSection(dict):
    """The schema of a section typed ``X | None``: absent or null, or checked when given."""


def _optional(schema: Any) -> bool:
    """May the key be absent or null? ``X | None``, or a section whose keys are all optional."""
    if isinstance(schema, Mapping):
        return isinstance(schema, _OptionalSection) or all(map(_optional, schema.values()))
    return _is_union(schema) and type(None) in typing.get_args(schema)


def check(cfg: DictConfig, schema: Mapping[str, Any], source: Source | None = None) -> None:
    """Raise :class:`ConfigError` listing every unknown key, wrong type and bad component."""
    src = source or Source()
    errors: list[str] = []
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # noqa: BLE001 - interpolation errors name the key themselves
        raise ConfigError(f"{src.path or 'config'}: {e}") from None
    _check(resolved, schema, "", src, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


# --------------------------------------------------------------------------- use


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a ``_component_`` node describes: ``resolve(node._component_)`` called
    with the node's other keys (interpolations resolved) as keyword arguments.

    Positional ``args`` and keyword ``kwargs`` are supplied by the recipe (e.g. the tokenizer or
    the model's parameters) and win over the config's keys. A module in the working directory
    resolves too (``_component_: my_rewards.score``), as under ``tune run``.
    """
    if node is None:
        return None
    if not OmegaConf.is_dict(node):
        raise ConfigError(
            f"cannot instantiate {type(node).__name__}: a _component_ mapping is needed"
        )
    container = OmegaConf.to_container(node, resolve=True)
    if "_component_" not in container:
        raise ConfigError(f"cannot instantiate {sorted(container)}: the mapping has no _component_")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # appended: the working directory never shadows a package
    target = resolve(container.pop("_component_"))
    kwargs = {**container, **kwargs}
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no section arguments
        hints = {}
    for name, sec in _section_args(hints).items():  # a mapping for a section argument: read it
        if isinstance(kwargs.get(name), Mapping):
            kwargs[name] = sec.read(kwargs[name], f"{name}.")
    return target(*args, **kwargs)


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """Split a recipe's argv into the ``--config`` path and the ``key=value`` overrides."""
    config_path, rest, args = None, [], iter(argv)
    for a in args:
        if a == "--config":
            config_path = next(args, None)
            if config_path is None:
                raise ConfigError("--config needs a path")
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
        else:
            rest.append(a)
    if config_path is None:
        raise ConfigError("missing --config <path.yaml>")
    return config_path, rest


def parse(
    recipe_main: Callable[..., Any] | None = None,
    *,
    schema: Mapping | None = None,
    options: Callable[[DictConfig], Any] | None = None,
) -> Callable[..., Any]:
    """Decorate a recipe's ``recipe_main``: read ``--config`` and overrides from ``sys.argv``,
    check them against ``schema`` (the recipe's ``CONFIG_SCHEMA``), then build the recipe's
    options with ``options`` (its pure ``build_options(cfg)``, which owns every default and
    cross-field check) and call ``recipe_main(cfg, opts)`` (``recipe_main(cfg)`` without one).

    Any :class:`ConfigError` (or ``ValueError`` from ``build_options``) prints one message and
    exits with status 2 before anything heavy runs. Works under ``lightrft run`` and ``torchrun``
    (and torchtune's ``tune run`` where torchtune is installed: the recipe reads its own argv).
    """
    if recipe_main is None:
        return functools.partial(parse, schema=schema, options=options)

    @functools.wraps(recipe_main)
    def wrapper() -> None:
        try:
            cfg, src = load(*split_argv(sys.argv[1:]))
            opts = validate(cfg, schema=schema, options=options, source=src)
        except UserError as e:  # a config error, or a damaged checkpoint found by a resume check
            print(f"lightrft: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            result = recipe_main(cfg) if options is None else recipe_main(cfg, opts)
        except UserError as e:
            if os.environ.get("LIGHTRFT_TRACEBACK"):
                raise
            # A config mistake found while running (a model path a prepare step did not
            # write...) reads like one `validate` finds: the place of the key, then the reason.
            where = _place(str(e), src) if isinstance(e, ConfigError) else type(e).__name__
            print(f"lightrft: {where}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        sys.exit(result)

    return wrapper


def validate(
    cfg: DictConfig,
    *,
    schema: Mapping | None = None,
    options: Callable[[DictConfig], Any] | None = None,
    source: Source | None = None,
) -> Any:
    """The schema check, then ``options(cfg)``: what ``lightrft validate`` and ``run`` both do.

    Returns the options object (None without ``options``). A ``ValueError`` raised by
    ``options`` becomes a :class:`ConfigError` whose message points at the config file, so the
    two commands print the same line for the same mistake.
    """
    if schema is not None:
        check(cfg, schema, source)
    if options is None:
        return None
    try:
        return options(cfg)
    except ConfigError:
        raise
    except ValueError as e:  # (a CheckpointError is no ValueError: never pinned on the config)
        raise ConfigError(f"{_place(str(e), source or Source())}: {e}") from None


def _place(message: str, src: Source) -> str:
    """Where the first config key named in ``message`` comes from (file:line or override)."""
    for token in re.findall(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", message):
        probe = token
        while probe:
            if probe in src.lines or probe in src.overrides:
                return src.where(token)
            probe = probe.rpartition(".")[0]
    return src.path or "config"


# --------------------------------------------------------------------------- typed sections


_MISSING = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    doc: str = "",
    ge: float | None = None,
    gt: float | None = None,
    flat: bool = False,
    default_factory: Any = _MISSING,
) -> Any:
    """A field of a :class:`Section`: its default (none: the key is required), one line of
    documentation (the docs table of the section is made from it), and a lower bound checked on
    read (``ge``: ``>=``, ``gt``: ``>``). ``flat``: a nested section whose keys sit at this
    level (the top-level keys several sections share, e.g. ``output_dir`` and ``optimizer``)."""
    meta = {"doc": doc, "bound": Bound(ge=ge, gt=gt), "flat": flat}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def section(cls: type) -> type:
    """Declare a :class:`Section` subclass: a frozen, keyword-only dataclass whose annotations
    are resolved now, while its module's names are there (a recipe runs as a script)."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    cls._hints = typing.get_type_hints(cls)
    return cls


class Section:
    """A config section as a frozen dataclass that *is* its schema.

    Each field is a key: its annotation is the key's type (``Literal`` for choices, ``X | None``
    for a key whose default is None, :class:`Component` for a ``_component_`` node, which stays a
    config node for :func:`instantiate`), a field without a default is a required key, and
    ``null`` means "the default" for every other one. A field whose type is another section is
    a nested mapping (or, with ``option(flat=True)``, keys at the same level). Bounds come from
    :func:`option`; rules across fields live in :meth:`resolve`, which may also fill in
    defaults that depend on other keys. :meth:`schema` gives the strict checker its schema,
    :meth:`read` builds the checked object from a config node, :meth:`doc_table` its docs.
    """

    @classmethod
    def _fields(cls) -> list[tuple[dataclasses.Field, Any, type[Section] | None]]:
        """Each field, its type and the section class it is (None for a plain key)."""
        hints = cls.__dict__.get("_hints") or typing.get_type_hints(cls)
        return [(f, hints[f.name], _section_type(hints[f.name])) for f in dataclasses.fields(cls)]

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The strict checker's schema of this section (see :func:`check`)."""
        out: dict[str, Any] = {}
        for f, t, section in cls._fields():
            if section is None:
                keys = {f.name: t if _default(f) is _MISSING or _optional(t) else t | None}
            elif f.metadata.get("flat"):
                keys = section.schema()
            else:
                sub = section.schema()
                keys = {f.name: _OptionalSection(sub) if _optional(t) else sub}
            dup = set(keys) & set(out)
            if dup:
                raise TypeError(f"{cls.__name__}: keys {sorted(dup)} declared twice")
            out.update(keys)
        return out

    @classmethod
    def read(cls, node: Any, at: str = "") -> Section:
        """The section from a (schema-checked) config node: defaults for absent / null keys,
        lists as tuples, bounds checked, then :meth:`resolve`. ``at`` is the dotted prefix of
        the section's keys (``"model."``), used in error messages."""
        values: dict[str, Any] = {}
        for f, t, section in cls._fields():
            value = None if node is None else node.get(f.name)
            if section is not None:  # a nested mapping (absent: None if optional), or flat keys
                if f.metadata.get("flat"):
                    value = section.read(node, at)
                elif value is not None or not _optional(t):
                    value = section.read(value, f"{at}{f.name}.")
            elif value is None and (default := _default(f)) is not _MISSING:
                value = default
            if isinstance(value, (list, tuple, ListConfig)):
                value = tuple(value)
            elif isinstance(value, DictConfig) and not _is_component_type(t):
                value = OmegaConf.to_container(value, resolve=True)
            values[f.name] = value
        return cls(**values).checked(at)

    def checked(self, at: str = "") -> Section:
        """The section checked, then :meth:`resolve`: each key's declared type (a section built
        in Python skips the schema check), choices (``Literal``) and :func:`option` bounds, with
        ``at`` (the keys' dotted prefix) in the message. :meth:`read` ends with it; a section
        built in Python calls it before use (``MediaOptions(...).checked("media.")``)."""
        for f, t, section in self._fields():
            value = getattr(self, f.name)
            if section is not None or value is None:
                continue
            key = f"{at}{f.name}"
            if not _matches(value, t):
                raise ValueError(f"{key} expects {_type_name(t)}, got {value!r}")
            f.metadata["bound"].check(key, value)
        return self.resolve(at)

    def is_set(self) -> bool:
        """Whether any key of the section has a value (an all-null section counts as absent:
        sections whose presence switches a feature on keep their keys' defaults null)."""
        return any(
            v.is_set() if isinstance(v, Section) else v is not None for v in vars(self).values()
        )

    def resolve(self, at: str) -> Section:
        """Rules across fields (raise ``ValueError`` naming the keys with ``at`` in front) and
        defaults that depend on other keys (return a ``dataclasses.replace``d copy)."""
        return self

    @classmethod
    def doc_table(cls, at: str = "") -> str:
        """A Markdown table of the section's keys: key, type, default, meaning."""
        header = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        return "\n".join(header + cls._doc_rows(at))

    @classmethod
    def _doc_rows(cls, at: str) -> list[str]:
        rows = []
        for f, t, section in cls._fields():
            if section is not None:
                rows += section._doc_rows(at if f.metadata.get("flat") else f"{at}{f.name}.")
                continue
            if (default := _default(f)) is _MISSING:
                default = "required"
            else:
                default = "null" if default is None else f"`{_yaml_value(default)}`"
            kind = _type_name(t).replace("|", "or")
            rows.append(f"| `{at}{f.name}` | {kind} | {default} | {f.metadata.get('doc', '')} |")
        return rows


def _default(f: dataclasses.Field) -> Any:
    """A field's default (its factory's value), ``dataclasses.MISSING`` for a required key."""
    return f.default if f.default_factory is _MISSING else f.default_factory()


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def _section_type(t: Any) -> type[Section] | None:
    """The Section class of a field type (``S`` or ``S | None``), else None."""
    if _is_union(t):
        inner = [a for a in typing.get_args(t) if a is not type(None)]
        t = inner[0] if len(inner) == 1 else None
    return t if isinstance(t, type) and issubclass(t, Section) else None


def _section_args(hints: Mapping[str, Any]) -> dict[str, type[Section]]:
    """The arguments of a component whose type is a :class:`Section` (a nested mapping in
    YAML, checked against the section's schema and read into it)."""
    return {n: s for n, t in hints.items() if (s := _section_type(t)) is not None}


def _is_component_type(t: Any) -> bool:
    return t is Component or (_is_union(t) and Component in typing.get_args(t))


def at_least(key: str, value: Any, low: float, *, strict: bool = False) -> None:
    """``value`` (None: unset) must be ``>= low`` (``> low`` if ``strict``); names ``key``."""
    if value is not None and not (value > low if strict else value >= low):  # NaN fails too
        raise ValueError(f"{key} must be {'>' if strict else '>='} {low:g}, got {value}")
