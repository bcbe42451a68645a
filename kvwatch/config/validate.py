"""The generic validator: reads a YAML mapping into a schema dataclass, driven by its fields' metadata.

A schema field declares its YAML key, its kind (how a value is read), its bounds or choices and its
doc in ``field(metadata=...)`` (see ``setting``). ``read_section`` walks a mapping against that
metadata: types, bounds, choices, unknown keys, required keys, nested sections and lists of entries.
Every problem is collected with its key path (``replicas[1].metrics_url``) so a user fixes a file
in one pass; a quoted value is cut to QUOTE_LIMIT characters, so no message grows with the input.
The SLO file (``kvwatch/mixin/slo.py``) is read with the same reader and kinds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from kvwatch.jsonsafe import finite
from kvwatch.model import LengthBands

#: Longest quotation of a given value in an error message, in characters.
QUOTE_LIMIT = 80


class ConfigError(ValueError):
    """One or more configuration problems, each as ``(key_path, reason)``."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        self.source = source
        lines = [f"{source}: {len(problems)} problem(s)"]
        lines += [f"  {path}: {reason}" for path, reason in problems]
        super().__init__("\n".join(lines))


def brief(text: str, limit: int = QUOTE_LIMIT) -> str:
    """Cut ``text`` to ``limit`` characters, so no error message grows with the input."""
    return text if len(text) <= limit else text[:limit] + "…"


def quoted(value: Any) -> str:
    """``repr(value)`` cut to QUOTE_LIMIT characters: how error messages quote what they were given."""
    return brief(repr(value))


# --------------------------------------------------------------------------------------------
# kinds of value: each reader raises ValueError with the message the user sees
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kind:
    """How one kind of value is read (``parse``) and how docs/config.md names it (``name``)."""

    name: str
    parse: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}")  # fullmatch: `$` also matched before a final newline


#: a host name (RFC 1123 labels) or an IPv4 / IPv6 literal (hex, dots, colons, a %zone)
_HOST = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9\-_]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9\-_]*[A-Za-z0-9])?)*\.?|[0-9A-Fa-f:.]+(%[\w.\-]+)?"
)


def parse_host_port(value: Any) -> HostPort:
    """``HOST:PORT`` or ``:PORT`` (all interfaces, said explicitly); IPv6 as ``[::1]:PORT``."""
    text = _scalar_text(value).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {quoted(text)}")
    host = host.strip("[]") or "0.0.0.0"
    if not _HOST.fullmatch(host):  # "http://127.0.0.1:9477" or a space failed only at bind, unnamed
        raise ValueError(f"expected HOST:PORT with a host name or IP address, got {quoted(text)}")
    try:
        num = int(port)
    except ValueError:
        raise ValueError(f"port must be a number in {quoted(text)}") from None
    if not 0 <= num <= 65535:
        raise ValueError(f"port {num} out of range 0..65535")
    return HostPort(host, num)


MAX_DURATION_S = 365 * 86400.0  # no interval, timeout or SLO period a node agent means is longer


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``500ms``, ``5s``, ``2m``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 5s or 500ms")
    if isinstance(value, int | float):
        number = finite(value)
        seconds = math.inf if number is None else number  # too large for a float: refused below
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"expected a duration such as 5s or 500ms, got {quoted(value)}")
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    if not 0 < seconds < math.inf:
        raise ValueError(f"duration must be positive and finite, got {quoted(value)}")
    if seconds > MAX_DURATION_S:
        # past ~8.6e13 s the scheduler's datetime arithmetic overflows when the agent starts
        raise ValueError(f"duration must be at most a year ({MAX_DURATION_S:g} s), got {quoted(value)}")
    return seconds


def parse_size(value: Any) -> int:
    """Bytes from a number or a string like ``16MiB``."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16MiB")
    if isinstance(value, int | float):
        if finite(value) is None:
            raise ValueError(f"expected a size such as 16MiB or 1000000, got {quoted(value)}")
        size = int(value)
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"expected a size such as 16MiB or 1000000, got {quoted(value)}")
        scaled = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()]
        if not math.isfinite(scaled):  # 400 digits read as a float are infinite
            raise ValueError(f"expected a size such as 16MiB or 1000000, got {quoted(value)}")
        size = int(scaled)
    if size <= 0:
        raise ValueError(f"size must be positive, got {quoted(value)}")
    return size


def short_name(value: Any) -> str:
    """A replica, node or SLO name: a label value short and plain enough for any config or query."""
    text = _scalar_text(value)
    if not _NAME.fullmatch(text):
        raise ValueError(f"expected a short name of letters, digits, '_', '.', '-', got {quoted(text)}")
    return text


def _scalar_text(value: Any) -> str:
    """A string, or a number written without quotes; a list, mapping, boolean or null is refused."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {type(value).__name__} {quoted(value)}")
    return str(value)


def _http_url(value: Any) -> str:
    text = _scalar_text(value)
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"expected an http(s) URL, got {quoted(text)}")
    return text


def _base_url(value: Any) -> str:
    return _http_url(value).rstrip("/")


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {quoted(value)}")
    return value


def _worker_count(value: Any) -> int | None:
    """``auto`` (None: decided at start from the CPUs and replicas) or a whole number >= 0."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, str) and value.strip().isdigit():  # a KVWATCH_* override is text
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected auto or a whole number of processes (0 or 1: none), got {quoted(value)}")
    return value


def _positive_number(value: Any) -> float:
    number = finite(value)
    if number is None or number <= 0:
        raise ValueError(f"expected a positive number, got {quoted(value)}")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {quoted(value)}")


def _word(value: Any) -> str:
    return _scalar_text(value).lower()


def _str_tuple(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list of strings, got {quoted(value)}")
    return tuple(_scalar_text(v) for v in value)


def _edges(value: Any) -> LengthBands:
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of ascending token counts, e.g. [1000, 5000, 10000, 20000]")
    edges = tuple(_whole_tokens(v) for v in value)
    if None in edges:
        raise ValueError(f"edges must be whole token counts, got {quoted(value)}")
    return LengthBands(tuple(e for e in edges if e is not None))


def _whole_tokens(value: Any) -> int | None:
    """1000, 1000.0 (YAML) or "1000" (an environment variable); None for 1000.9, .inf or true,
    which ``int()`` would cut, overflow on, or read as 1."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _socket_path(value: Any) -> str:
    text = _scalar_text(value)
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute path for a Unix socket, got {quoted(text)}")
    if len(text.encode()) > 107:
        raise ValueError("a Unix socket path is at most 107 bytes")
    return text


#: a pod UID is 36 bytes, "/" and "/vllm.sock" 11 more: what ``vllm_plugin_dir`` may take of 107
PLUGIN_DIR_MAX_BYTES = 107 - 36 - 11


def _plugin_dir(value: Any) -> str:
    text = _scalar_text(value).rstrip("/") or "/"
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute directory, got {quoted(text)}")
    if len(text.encode()) > PLUGIN_DIR_MAX_BYTES:
        raise ValueError(
            f"at most {PLUGIN_DIR_MAX_BYTES} bytes (a Unix socket path is at most 107, and "
            "<pod uid>/vllm.sock takes 47)"
        )
    return text


STRING = Kind("string", _scalar_text)
NAME = Kind("name", short_name)
WORD = Kind("string", _word)  # lower-cased, for choices
PATH = Kind("path", _scalar_text)
SOCKET_PATH = Kind("socket path", _socket_path)
PLUGIN_DIR = Kind("directory of sockets", _plugin_dir)
URL = Kind("http(s) URL", _http_url)
BASE_URL = Kind("http(s) URL", _base_url)
HOST_PORT = Kind("HOST:PORT", parse_host_port)
DURATION = Kind("duration", parse_duration)
SIZE = Kind("size", parse_size)
INTEGER = Kind("integer", _integer)
WORKER_COUNT = Kind("auto or integer", _worker_count)
POSITIVE_NUMBER = Kind("number > 0", _positive_number)
BOOL = Kind("boolean", _bool)
STRINGS = Kind("list of strings", _str_tuple)
EDGES = Kind("list of token counts", _edges)


# --------------------------------------------------------------------------------------------
# schema metadata
# --------------------------------------------------------------------------------------------


def setting(
    key: str,
    kind: Kind,
    doc: str,
    *,
    minimum: float | None = None,
    choices: tuple[str, ...] | None = None,
    shown_default: str | None = None,
    choice_name: str | None = None,
) -> dict[str, Any]:
    """The metadata of one setting: ``field(default=..., metadata=setting("key", KIND, "doc"))``.

    ``choices`` bound a value (or each item of a list); ``choice_name`` names one in errors (default:
    the key); ``shown_default`` is how docs/config.md writes a default computed at run time.
    """
    given = {"choice_name": choice_name, "min": minimum, "choices": choices, "shown_default": shown_default}
    return {"key": key, "kind": kind, "doc": doc, **{k: v for k, v in given.items() if v is not None}}


def caller_reads(key: str, doc: str) -> dict[str, Any]:
    """The metadata of a key whose rule depends on other keys: declared here, read by its module."""
    return {"key": key, "doc": doc, "caller_reads": True}


def section(key: str, cls: type, doc: str) -> dict[str, Any]:
    """The metadata of a nested mapping read into the schema dataclass ``cls``."""
    return {"key": key, "section": cls, "doc": doc}


def entries(key: str, cls: type, doc: str) -> dict[str, Any]:
    """The metadata of a list of mappings, each read into the schema dataclass ``cls``."""
    return {"key": key, "entries": cls, "doc": doc}


def schema_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """YAML key -> dataclass field, for every field of ``cls`` that declares a key."""
    return {f.metadata["key"]: f for f in dataclasses.fields(cls) if "key" in f.metadata}


def is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def check_bounds(meta: Mapping[str, Any], value: Any) -> None:
    """ValueError when ``value`` is outside the setting's ``min`` or ``choices``."""
    minimum = meta.get("min")
    if minimum is not None and value < minimum:
        raise ValueError(f"expected at least {minimum:g}, got {quoted(value)}")
    choices = meta.get("choices")
    if choices is not None:
        items = value if isinstance(value, tuple) else (value,)
        bad = [item for item in items if item not in choices]
        if bad:
            label = meta.get("choice_name", meta["key"])
            named = brief(", ".join(map(repr, bad)))
            raise ValueError(f"unknown {label} {named} (one of {', '.join(choices)})")


def read_value(meta: Mapping[str, Any], raw: Any) -> Any:
    """One scalar setting read by its kind, then checked against its bounds and choices."""
    value = meta["kind"].parse(raw)
    check_bounds(meta, value)
    return value


# --------------------------------------------------------------------------------------------
# the reader
# --------------------------------------------------------------------------------------------


class KeyPathReader:
    """Walks a YAML mapping, collecting every problem with its key path (also reads the SLO file)."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def problem(self, path: str, reason: str) -> None:
        self.problems.append((path, reason))

    def mapping(self, node: Any, path: str, allowed: set[str] | Mapping[str, Any]) -> Mapping[str, Any]:
        if node is None:
            return {}
        if not isinstance(node, Mapping):
            self.problem(path or "(top level)", f"expected a mapping, got {type(node).__name__}")
            return {}
        for key in node:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                self.problem(join(path, brief(str(key))), f"unknown key (known keys: {hint})")
        return node

    def get(
        self,
        node: Mapping[str, Any],
        key: str,
        path: str,
        conv: Callable[[Any], Any],
        default: Any = None,
        required: bool = False,
    ) -> Any:
        if key not in node or node[key] is None:
            if required:
                self.problem(join(path, key), "required")
            return default
        try:
            return conv(node[key])
        except (ValueError, TypeError) as exc:
            self.problem(join(path, key), str(exc))
            return default

    def setting(self, node: Mapping[str, Any], key: str, path: str, f: dataclasses.Field[Any]) -> Any:
        """One field of a schema dataclass, read as its metadata says (None when absent or bad)."""
        meta = f.metadata
        if "section" in meta:
            read = self.section(node.get(key), join(path, key), meta["section"])
            return default_of(f) if read is None else read
        if "entries" in meta:
            return self.entries(node.get(key), join(path, key), meta["entries"])
        if key in node and node[key] is None and "None" in str(f.type):
            # an explicit null where null means something (ca_file: null, the system's CAs), not
            # "the default": the default of such a key is a value, and null turns it off
            return None
        return self.get(
            node, key, path, lambda raw: read_value(meta, raw), default=default_of(f), required=is_required(f)
        )

    def values(self, node: Any, path: str, cls: type, also: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Attribute -> value for every keyed field of ``cls`` found in ``node`` (defaults elsewhere).

        A field whose metadata has no kind (``caller_reads``) is a known key the caller reads itself,
        because its rule depends on other keys (the SLO file's bands and thresholds). ``also`` are
        further keys ``node`` may hold, read by the caller.
        """
        keyed = schema_fields(cls)
        m = self.mapping(node, path, {*keyed, *also})
        return {
            f.name: self.setting(m, key, path, f)
            for key, f in keyed.items()
            if not f.metadata.get("caller_reads")
        }

    def section(self, node: Any, path: str, cls: type) -> Any:
        """``node`` read into ``cls``; None when a required key is missing or bad (it was reported)."""
        if node is not None and not isinstance(node, Mapping):
            self.mapping(node, path, set())  # one problem: not a mapping (not one per required key)
            return None
        values = self.values(node, path, cls)
        if any(is_required(f) and values.get(f.name) is None for f in dataclasses.fields(cls)):
            return None
        return cls(**values)

    def entries(self, node: Any, path: str, cls: type) -> tuple[Any, ...]:
        """A list of mappings, each read into ``cls``; bad entries are reported and left out."""
        if node is None:
            return ()
        if not isinstance(node, list):
            keys = ", ".join(schema_fields(cls))
            self.problem(path, f"expected a list of {{{keys}}}")
            return ()
        out = []
        for i, item in enumerate(node):
            where = f"{path}[{i}]"
            if isinstance(item, Mapping) and not item:
                self.problem(
                    where,
                    "empty entry: needs at least "
                    + ", ".join(key for key, f in schema_fields(cls).items() if is_required(f)),
                )
                continue
            entry = self.section(item, where, cls)
            if entry is not None:
                out.append(entry)
        return tuple(out)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
