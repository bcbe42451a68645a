"""The config schema is the one place a key is declared: environment overrides go through the same
validator as the file, docs/config.md is generated from it, and no other doc names a key it lacks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.config import ConfigError, config_from_mapping, env_variable, load_config
from kvwatch.config.schema import Config
from kvwatch.config.validate import schema_fields
from tests.config.keys import every_key_path, leaf_keys

ROOT = Path(__file__).resolve().parents[2]


def _problems(fn, *args) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    return dict(err.value.problems)


def _nest(parts: tuple[str, ...], value: object) -> dict:
    node: object = value
    for part in reversed(parts):
        node = {part: node}
    assert isinstance(node, dict)
    return node


@pytest.mark.parametrize("parts", leaf_keys(), ids=".".join)
def test_every_override_is_validated_like_its_file_key_and_names_the_variable(parts):
    dotted, variable = ".".join(parts), env_variable(parts)
    from_file = _problems(config_from_mapping, _nest(parts, {"x": 1}))
    from_env = _problems(load_config, None, {variable: "{x: 1}"})
    assert from_env == {f"{variable} ({dotted})": from_file[dotted]}


def test_a_null_override_is_an_error_not_a_return_to_all_interfaces(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text("listen: 127.0.0.1:9477\nnode: n1\n")
    for value in ("~", "null"):  # today: both silently gave 0.0.0.0:9477 and the host name
        found = _problems(load_config, path, {"KVWATCH_LISTEN": value, "KVWATCH_NODE": value})
        assert set(found) == {"KVWATCH_LISTEN", "KVWATCH_NODE"} and "is null" in found["KVWATCH_LISTEN"]
    assert load_config(path, {"KVWATCH_LISTEN": "  "}).listen.host == "127.0.0.1"  # blank: unset


def test_a_list_or_mapping_is_not_a_string_setting():
    # today: ledger.path became the string "['a', 'b']" and the token file "{'x': 1}"
    found = _problems(
        load_config,
        None,
        {"KVWATCH_LEDGER__PATH": "[a, b]", "KVWATCH_DISCOVERY__KUBERNETES__TOKEN_FILE": "{x: 1}"},
    )
    assert "expected a string" in found["KVWATCH_LEDGER__PATH (ledger.path)"]
    assert (
        "expected a string"
        in found["KVWATCH_DISCOVERY__KUBERNETES__TOKEN_FILE (discovery.kubernetes.token_file)"]
    )


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("KVWATCH_PROXY__MAX_BODY", "no config key proxy.max_body"),  # today: named proxy.max_body only
        ("KVWATCH_VLLM_PLUGIN_SOCKETS__0__PATH", "cannot be set from the environment"),  # today: a list?
        ("KVWATCH_PROXY", "is a section"),
        ("KVWATCH_LOG_LEVEL__X", "a single value, not a section"),
    ],
)
def test_a_variable_that_names_no_settable_key_is_refused_by_name(name, fragment):
    found = _problems(load_config, None, {name: "/run/x.sock"})
    assert fragment in found[name]


def test_problems_inside_a_whole_list_name_the_variable_and_the_entry(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text("intervals: {engine: soon}\n")
    found = _problems(
        load_config,
        path,
        {"KVWATCH_REPLICAS": "[{name: 'a b', metrics_url: 'http://127.0.0.1:8000/metrics'}, {name: c}]"},
    )
    assert "expected a short name" in found["KVWATCH_REPLICAS (replicas[0].name)"]
    assert found["KVWATCH_REPLICAS (replicas[1].metrics_url)"] == "required"
    assert "intervals.engine" in found  # the file's problem is reported in the same pass


def test_the_dead_slots_interval_is_gone():
    assert "slots" not in schema_fields(schema_fields(Config)["intervals"].metadata["section"])
    assert "intervals.slots" in _problems(config_from_mapping, {"intervals": {"slots": "5s"}})


def test_docs_check_fails_on_a_stale_config_reference(tmp_path):
    stale = tmp_path / "config.md"
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    stale.write_text(text.replace("`intervals.gpu`", "`intervals.gpu_s`"), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", "docs", "--check", "--config-file", str(stale)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "config.md is stale" in result.stderr


def test_the_config_reference_lists_every_key_with_its_variable():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for parts in leaf_keys():
        assert f"| `{'.'.join(parts)}` |" in text and f"`{env_variable(parts)}`" in text
    assert all(f"`{path}`" in text for path in every_key_path() if "[]." in path)


#: a backticked ``section.key`` in prose, e.g. `intervals.gpu` or `replicas[].proxy_listen`
_MENTION = re.compile(
    r"`((?:"
    + "|".join(
        key for key, f in schema_fields(Config).items() if "section" in f.metadata or "entries" in f.metadata
    )
    + r")(?:\[\])?(?:\.[a-z_]+)+)`"
)


_FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "sock", "txt", "html"}  # `proxy.py` is a file


def test_every_config_key_the_docs_mention_exists():
    known = every_key_path()
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for mention in _MENTION.findall(page.read_text(encoding="utf-8")):
            if mention not in known and mention.rpartition(".")[2] not in _FILE_SUFFIXES:
                wrong.append(f"{page.relative_to(ROOT)}: {mention}")
    assert not wrong, wrong


def test_an_entry_or_section_that_is_not_a_mapping_is_one_problem_not_one_per_key():
    data = {"replicas": [5, {"name": "r", "metrics_url": "nope"}], "proxy": 3}
    found = _problems(config_from_mapping, data)
    assert found == {
        "replicas[0]": "expected a mapping, got int",
        "proxy": "expected a mapping, got int",
        "replicas[1].metrics_url": "expected an http(s) URL, got 'nope'",
    }
