"""The loader: a YAML file (bounded safe YAML), ``KVWATCH_*`` environment overrides, defaults.

A file is read with ``safe_load`` (aliases bounded), each ``KVWATCH_*`` variable is resolved against
the schema and put in the place of the key it overrides, and the whole is validated once by the
generic validator, then by the checks that span keys (duplicate names, replicas that must exist).
Every problem is reported at once; one that comes from a variable names the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvwatch.config.schema import ENV_PREFIX, Config
from kvwatch.config.validate import ConfigError, HostPort, KeyPathReader, brief, join, schema_fields

#: Most values a YAML document may stand for once its aliases are expanded (a config has hundreds).
MAX_YAML_NODES = 100_000


def config_from_mapping(
    data: Any, source: str = "config", variables: Mapping[str, str] | None = None
) -> Config:
    """Validate a parsed YAML document; raise ConfigError listing every problem.

    ``variables`` maps a key path set from the environment to its variable, so that a problem at or
    below that path names the variable (``KVWATCH_REPLICAS (replicas[0].name)``).
    """
    r = KeyPathReader()
    cfg = r.section(data, "", Config)
    if cfg is not None:
        _cross_checks(r, data, cfg)
    if r.problems:
        raise ConfigError(
            [(_name_variable(path, variables or {}), reason) for path, reason in r.problems], source
        )
    assert cfg is not None  # a None section always comes with a problem
    return cfg


def _cross_checks(r: KeyPathReader, data: Any, cfg: Config) -> None:
    """The rules that span keys: what one key alone cannot say (entries with bad keys included)."""
    replicas = _partial_entries(data, Config, "replicas")
    seen: dict[str, int] = {}
    for i, rep in replicas:
        if rep["name"] in seen:
            r.problem(f"replicas[{i}].name", f"duplicate replica name {rep['name']!r}")
        if rep["name"] is not None:
            seen[rep["name"]] = i
        if rep["proxy_listen"] is not None and rep["api_url"] is None:
            r.problem(
                f"replicas[{i}].proxy_listen", "needs api_url: the engine's OpenAI base URL to forward to"
            )
    listeners = [("listen", cfg.listen), ("otlp.listen", cfg.otlp.listen)]
    listeners += [(f"replicas[{i}].proxy_listen", rep["proxy_listen"]) for i, rep in replicas]
    _distinct_listeners(r, listeners)
    proxy, otlp = cfg.proxy, cfg.otlp
    if proxy.max_buffered_bytes < proxy.max_body_bytes:
        r.problem(
            "proxy.max_buffered_bytes",
            f"must be at least proxy.max_body_bytes "
            f"({proxy.max_body_bytes}), or a body within that limit could never be buffered",
        )
    if otlp.max_decompressed_bytes < otlp.max_body_bytes:
        r.problem(
            "otlp.max_decompressed_bytes",
            f"must be at least otlp.max_body_bytes "
            f"({otlp.max_body_bytes}), or an uncompressed export within that limit would be refused",
        )
    if otlp.replica is not None and otlp.replica not in seen:
        r.problem("otlp.replica", f"no replica named {otlp.replica!r}")
    for i, files in _partial_entries(data, Config, "sglang_request_files"):
        if files["replica"] is not None and files["replica"] not in seen:
            r.problem(f"sglang_request_files[{i}].replica", f"no replica named {files['replica']!r}")
    owners: dict[str, str] = {}
    for i, sock in _partial_entries(data, Config, "vllm_plugin_sockets"):
        path = f"vllm_plugin_sockets[{i}]"
        rep_name, sock_path = sock["replica"], sock["path"]
        if rep_name is not None and rep_name not in seen:
            r.problem(join(path, "replica"), f"no replica named {rep_name!r}")
        elif rep_name is not None and rep_name in owners.values():
            r.problem(join(path, "replica"), f"replica {rep_name!r} already has a socket")
        if sock_path is not None and sock_path in owners:
            r.problem(join(path, "path"), f"{sock_path!r} is already another replica's socket")
        if rep_name is not None and sock_path is not None:
            owners.setdefault(sock_path, rep_name)


_ANY_HOST = frozenset({"", "0.0.0.0", "::", "*"})


def _distinct_listeners(r: KeyPathReader, listeners: Sequence[tuple[str, HostPort | None]]) -> None:
    """Two sockets on one port fail at start unless both name distinct addresses (a wildcard
    address takes the port on all of them); port 0 is any free port, never a clash."""
    bound: list[tuple[str, HostPort]] = []
    for path, listen in listeners:
        if listen is None or not listen.port:
            continue
        for other_path, other in bound:
            if other.port == listen.port and (
                listen.host == other.host or {listen.host, other.host} & _ANY_HOST
            ):
                r.problem(path, f"port {listen.port} is already {other_path}'s ({other})")
                break
        else:
            bound.append((path, listen))


def _partial_entries(data: Any, cls: type, key: str) -> list[tuple[int, dict[str, Any]]]:
    """(index, attribute -> value or None) of each mapping in the list at ``key``, bad keys as None.

    Its problems were already reported by the main read, so they are dropped here.
    """
    node = data.get(key) if isinstance(data, Mapping) else None
    if not isinstance(node, list):
        return []
    item_cls = schema_fields(cls)[key].metadata["entries"]
    return [
        (i, KeyPathReader().values(item, "", item_cls))
        for i, item in enumerate(node)
        if isinstance(item, Mapping) and item
    ]


def _name_variable(path: str, variables: Mapping[str, str]) -> str:
    """``path`` prefixed with the variable that set it or a key above it, if any did."""
    for key, variable in variables.items():
        if path == key or path.startswith((key + ".", key + "[")):
            return f"{variable} ({path})"
    return path


# --------------------------------------------------------------------------------------------
# environment overrides
# --------------------------------------------------------------------------------------------


def env_key_path(name: str) -> tuple[str, ...]:
    """``KVWATCH_DISCOVERY__KUBERNETES__ENABLED`` -> ``("discovery", "kubernetes", "enabled")``."""
    return tuple(p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p)


def env_variable(path: tuple[str, ...]) -> str:
    """The variable that overrides the key at ``path`` (the inverse of env_key_path)."""
    return ENV_PREFIX + "__".join(p.upper() for p in path)


def _resolve(parts: tuple[str, ...]) -> str | None:
    """Why ``parts`` is not a key a variable may set, or None when it is one."""
    cls: type = Config
    for depth, part in enumerate(parts):
        keyed = schema_fields(cls)
        where = ".".join(parts[: depth + 1])
        f = keyed.get(part)
        if f is None:
            return f"no config key {brief(where)} (known keys here: {', '.join(sorted(keyed))})"
        last = depth == len(parts) - 1
        if "entries" in f.metadata and not last:
            return (
                f"{part} entries cannot be set from the environment; list them in the config file, "
                f"or set the whole list as {env_variable(parts[: depth + 1])}"
            )
        if "section" in f.metadata:
            if last:
                example = env_variable((*parts, next(iter(schema_fields(f.metadata["section"])))))
                return f"{where} is a section; set one of its keys, e.g. {example}"
            cls = f.metadata["section"]
        elif not last:
            return f"{'.'.join(parts[: depth + 1])} is a single value, not a section"
    return None


def read_env_overrides(
    environ: Mapping[str, str],
) -> tuple[dict[tuple[str, ...], tuple[str, Any]], list[tuple[str, str]]]:
    """(key path -> (variable, value), problems named by variable) for every ``KVWATCH_*`` variable.

    Values are read as YAML scalars (``true``, ``5``, ``[1000, 5000]``). A blank value means the
    variable is unset (the file's value stays: ``KVWATCH_LISTEN=`` never means all interfaces); a
    null (``~``, ``null``) is an error rather than a silent return to the default.
    """
    found: dict[tuple[str, ...], tuple[str, Any]] = {}
    problems: list[tuple[str, str]] = []
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == "KVWATCH_CONFIG" or not raw.strip():
            continue
        parts = env_key_path(name)
        why = _resolve(parts) if parts else "not a config key"
        if why is not None:
            problems.append((brief(name), why))
            continue
        try:
            value = safe_load(raw)
        except yaml.YAMLError as exc:
            problems.append((name, f"not a valid YAML value: {brief(str(getattr(exc, 'problem', exc)))}"))
            continue
        except RecursionError:
            problems.append((name, "not a valid YAML value: nested too deeply"))
            continue
        if value is None:
            problems.append(
                (
                    name,
                    f"{brief(raw.strip())!r} is null; unset the variable to keep the "
                    "file's value or the default",
                )
            )
            continue
        if parts in found:
            problems.append((name, f"sets the same key as {found[parts][0]}"))
            continue
        found[parts] = (name, value)
    return found, problems


def _merge(data: Mapping[str, Any], overrides: Mapping[tuple[str, ...], tuple[str, Any]]) -> dict[str, Any]:
    out = dict(data)
    for parts, (_name, value) in overrides.items():
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is not None and not isinstance(child, Mapping):
                break  # the file's section is no mapping: left as written, for the validator to name
            child = dict(child) if child is not None else {}
            node[part] = child
            node = child
        else:
            node[parts[-1]] = value
    return out


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVWATCH_LISTEN=:9000``, ``KVWATCH_INTERVALS__ENGINE=2s``: ``__`` separates nesting.

    The document with every override in place; ConfigError names the variable of every problem
    found in the variables themselves (load_config also names it for problems of their values).
    """
    overrides, problems = read_env_overrides(environ)
    if problems:
        raise ConfigError(problems, "environment")
    return _merge(data, overrides)


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------


class BoundedSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand past MAX_YAML_NODES nodes.

    Aliases share one node, so a 400-byte "billion laughs" file parses small but expands to ~10^9
    values the moment anything walks or quotes it. The expanded size is counted on the node graph
    (each node once, memoised), in time linear in the file, before anything is constructed.
    """

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _expanded_size(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """A key written twice in one mapping is refused: PyYAML keeps the last silently, so a second
        ``replicas:`` further down a file dropped every replica of the first. Keys a merge (``<<``)
        brings in may be overridden, as YAML means them to be."""
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                first = seen[key]
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _expanded_size(root: yaml.Node) -> int:
    """Nodes ``root`` stands for once every alias is expanded; YAMLError past MAX_YAML_NODES."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise yaml.YAMLError(f"aliases expand to more than {MAX_YAML_NODES} values")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.YAMLError("recursive alias (refers to the node that holds it)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with alias expansion bounded (BoundedSafeLoader)."""
    return yaml.load(text, Loader=BoundedSafeLoader)


def read_yaml_file(path: str | Path) -> Any:
    """Parse a YAML file; ConfigError names the file and the line of a syntax error."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("(file)", f"cannot read: {exc.strerror or exc}")], source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [("(file)", f"not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})")], source
        ) from None
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        reason = brief(str(getattr(exc, "problem", None) or exc))
        raise ConfigError([(where, f"not valid YAML: {reason}")], source) from None
    except RecursionError:
        raise ConfigError([("(file)", "not valid YAML: nested too deeply")], source) from None


def load_config(path: str | Path | None, environ: Mapping[str, str] | None = None) -> Config:
    """Read YAML (or start empty), apply ``KVWATCH_*`` overrides, validate: every problem at once."""
    environ = os.environ if environ is None else environ
    data: Any = {}
    source = "environment"
    if path is not None:
        source = str(path)
        data = read_yaml_file(path)
        data = {} if data is None else data  # an empty file; `[]`, `false` or `0` is no mapping
    if not isinstance(data, dict):
        raise ConfigError([("(top level)", "expected a mapping of settings")], source)
    overrides, env_problems = read_env_overrides(environ)
    variables = {".".join(parts): name for parts, (name, _value) in overrides.items()}
    try:
        cfg = config_from_mapping(_merge(data, overrides), source, variables)
    except ConfigError as err:
        raise ConfigError(env_problems + err.problems, source) from None
    if env_problems:
        raise ConfigError(env_problems, source)
    return cfg
