"""The part of kustomize that kvwatch's manifests use, so the tests can render overlays without it.

Supported: ``resources`` (files and kustomization directories), ``namespace`` and ``patches`` given
as ``path`` to a strategic-merge patch: maps merge, ``null`` deletes, and the pod lists whose
strategic-merge key is ``name`` (``containers``, ``initContainers``, ``env``, ``volumes``,
``volumeMounts``) merge element by element (``$patch: delete`` removes one); any other list is
refused. Anything
else in a kustomization raises ``UnsupportedError`` instead of being half-implemented. When ``kubectl``
is installed, ``test_kubernetes_manifests`` checks that this renders exactly what ``kubectl kustomize``
renders, so the subset cannot quietly drift from the real tool.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches"}
# Kinds without a namespace among those kvwatch ships (kustomize's namespace transformer skips them).
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "RuntimeClass"}


class UnsupportedError(ValueError):
    """A kustomization uses a feature outside this subset."""


def build(directory: Path) -> list[dict[str, Any]]:
    """Render a kustomization directory into its objects, in resource order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8")) or {}
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    if unknown:
        raise UnsupportedError(f"{directory}/kustomization.yaml: {sorted(unknown)} not in the subset")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedError(f"{directory}: only `patches: [{{path: FILE}}]` is supported, got {patch}")
        _apply(objects, yaml.safe_load((directory / patch["path"]).read_text(encoding="utf-8")), directory)
    return objects


def _apply(objects: list[dict[str, Any]], patch: dict[str, Any], directory: Path) -> None:
    kind, name = patch["kind"], patch["metadata"]["name"]
    targets = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(targets) != 1:
        raise UnsupportedError(f"{directory}: patch for {kind}/{name} matches {len(targets)} objects")
    _merge(targets[0], patch, f"{kind}/{name}")


#: pod-spec lists whose strategic-merge patch key is ``name`` (k8s.io/api core/v1 patchMergeKey)
NAMED_LISTS = {"containers", "initContainers", "env", "volumes", "volumeMounts"}


def _merge(target: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value, f"{where}.{key}")
        elif isinstance(value, list) and key in NAMED_LISTS:
            target[key] = _merge_named(target.get(key) or [], value, f"{where}.{key}")
        elif isinstance(value, list):
            raise UnsupportedError(f"{where}.{key}: list patches need strategic-merge keys")
        else:
            target[key] = copy.deepcopy(value)


def _merge_named(target: list[dict[str, Any]], patch: list[dict[str, Any]],
                 where: str) -> list[dict[str, Any]]:
    """Strategic merge by ``name``: matching elements merge in place, ``$patch: delete`` drops one, and
    elements only the patch has come first, in the patch's order (as kustomize's merge emits them)."""
    out = copy.deepcopy(target)
    added: list[dict[str, Any]] = []
    for element in patch:
        if "name" not in element:
            raise UnsupportedError(f"{where}: list element without the merge key name: {element}")
        index = next((i for i, t in enumerate(out) if t.get("name") == element["name"]), None)
        if element.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif "$patch" in element:
            raise UnsupportedError(f"{where}: $patch {element['$patch']!r} is not in the subset")
        elif index is None:
            added.append(copy.deepcopy(element))
        else:
            _merge(out[index], element, f"{where}[{element['name']}]")
    return added + out
