"""Recipe loading: TOML -> `extends` -> command-line overrides -> one validation -> frozen Config.

Every value remembers where it came from (a file, or the command line), so a validation error
names the place to fix: ``recipes/a.toml: train.max_steps: Input should be greater than 0``.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ValidationError

from trainbook.config.schema import Config
from trainbook.config.secrets import redact_tree
from trainbook.errors import TrainbookError

COMMAND_LINE = "command line"


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load a recipe file, apply `key.path=value` overrides and validate the result once."""
    path = Path(path)
    tree, origins = _read_recipe(path, chain=())
    for item in overrides:
        key, value = parse_override(item)
        _set(tree, key, value)
        origins.pop(key, None)  # re-insert: the newest origin of a key is the last one
        origins[key] = COMMAND_LINE
    tree.setdefault("run", {}).setdefault("name", path.stem)
    return validate(tree, origins, default_where=str(path))


def validate(tree: dict, origins: dict[str, str], default_where: str) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise _user_error(e, origins, default_where) from None


def dump_toml(cfg: Config) -> str:
    """Every field after extends and overrides, as a recipe that reproduces the run."""
    header = "# Resolved by trainbook: every field after `extends` and overrides.\n"
    return header + tomli_w.dumps(redact_tree(cfg.model_dump(mode="json", exclude_none=True)))


# ---- reading files -------------------------------------------------------------------------


def _read_recipe(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    if not path.is_file():
        where = str(chain[-1]) + ": extends" if chain else None
        raise TrainbookError(f"recipe file not found: {path}", where=where)
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise TrainbookError(f"`extends` cycle: {cycle}", where=str(path))
    try:
        tree = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TrainbookError(f"not valid TOML: {e}", where=str(path)) from None

    base_name = tree.pop("extends", None)
    if base_name is None:
        return tree, {key: str(path) for key in _leaf_keys(tree)}
    if not isinstance(base_name, str):
        raise TrainbookError("`extends` must be a file name (a string)", where=f"{path}: extends")
    base, origins = _read_recipe(path.parent / base_name, (*chain, resolved))
    # A child's `run.name` is its own: it must not inherit the parent's run name.
    base.get("run", {}).pop("name", None)
    _merge(base, tree)
    origins.update({key: str(path) for key in _leaf_keys(tree)})
    return base, origins


def _merge(base: dict, top: dict) -> None:
    """Tables merge key by key; any other value (lists included) replaces the base's."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        keys.extend(_leaf_keys(value, dotted + ".") if isinstance(value, dict) else [dotted])
    return keys


# ---- command-line overrides ----------------------------------------------------------------


def parse_override(item: str) -> tuple[str, Any]:
    """`train.max_steps=20` -> ("train.max_steps", 20), parsed to the field's type (`trainbook runs
    --where` reads its filters the same way)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise TrainbookError(f"override {item!r} is not of the form key.path=value", where=COMMAND_LINE)
    annotation = _annotation_at(key.split("."))
    if _accepts_text(annotation) and not text.lstrip().startswith(('"', "'")):
        return key, text  # a bare word for a string field: no quoting needed
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise TrainbookError(f"cannot parse value {text!r}", where=f"{COMMAND_LINE}: {key}") from None


def _annotation_at(parts: list[str]) -> Any:
    """The type annotation of a dotted key; unknown keys get a "did you mean" error."""
    model: type[BaseModel] = Config
    annotation: Any = Config
    for i, part in enumerate(parts):
        if model is None:
            raise TrainbookError(f"{parts[i - 1]!r} has no sub-keys", where=f"{COMMAND_LINE}: {'.'.join(parts)}")
        if part not in model.model_fields:
            where = f"{COMMAND_LINE}: {'.'.join(parts[: i + 1])}"
            raise TrainbookError(_unknown_key(part, model), where=where)
        annotation = model.model_fields[part].annotation
        model = annotation if _is_model(annotation) else None
    return annotation


def _accepts_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a validated string (env.torch = ">=2.13")
        return _accepts_text(typing.get_args(annotation)[0])
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_text(a) for a in typing.get_args(annotation) if a is not type(None))
    return False


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise TrainbookError(f"{part!r} is not a table", where=f"{COMMAND_LINE}: {dotted}")
        tree = node
    tree[leaf] = value


# ---- errors --------------------------------------------------------------------------------


def _user_error(e: ValidationError, origins: dict[str, str], default_where: str) -> TrainbookError:
    first = e.errors()[0]
    loc = first["loc"]
    key = ".".join(str(p) for p in loc if isinstance(p, str))
    dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if first["type"] == "extra_forbidden":
        message = _unknown_key(str(loc[-1]), _model_at(loc[:-1]))
    else:
        message = first["msg"].removeprefix("Value error, ")
    more = len(e.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' * (more > 1)})"
    source = _origin(key, origins, default_where)
    return TrainbookError(message, where=f"{source}: {dotted}" if dotted else source)


def _origin(key: str, origins: dict[str, str], default_where: str) -> str:
    """The file (or command line) that set `key`, or that set the table it belongs to."""
    while key:
        matches = [src for k, src in origins.items() if k == key or k.startswith(key + ".")]
        if matches:
            return matches[-1]
        key = key.rpartition(".")[0]
    return default_where


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue  # list index: the element type was taken when the list field was
        annotation = model.model_fields[part].annotation
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        model = annotation if _is_model(annotation) else None
        if model is None:
            return None
    return model


def _unknown_key(name: str, model: type[BaseModel] | None) -> str:
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key {name!r}{hint}"


def with_defaults(tree: dict) -> dict:
    """A saved config tree (a run's, a checkpoint manifest's, a baseline's) completed with the
    defaults of keys added since it was written, as `dump_toml` writes them, so that it compares
    equal to the same recipe today: each section is read back through its schema. A section that
    no longer validates (a key since renamed, a redacted secret) is kept as saved."""
    out = dict(tree)
    for name, field in Config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue  # `expect`, a list: kept as saved
        try:
            full = section.model_validate(tree.get(name, {})).model_dump(mode="json", exclude_none=True)
        except ValidationError:
            continue
        out[name] = _fill(tree[name], full) if name in tree else full
    return out


def _fill(saved: Any, full: Any) -> Any:
    """`saved` with the keys of `full` it lacks, in tables and in lists of tables (a source's new
    keys); whatever `saved` holds stays as saved, an unset (None) value too."""
    if isinstance(saved, dict) and isinstance(full, dict):
        return {**full, **{k: _fill(v, full.get(k)) for k, v in saved.items()}}
    if isinstance(saved, list) and isinstance(full, list) and len(saved) == len(full):
        return [_fill(a, b) for a, b in zip(saved, full)]
    return saved


def dotted_keys(tree: dict, prefix: str = "") -> dict:
    """Nested dicts -> one level keyed by dotted paths: {"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}.

    The names `key=value` overrides use; checkpoints store their tensors under the same paths.
    Lists (data.sources) stay whole values.
    """
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
