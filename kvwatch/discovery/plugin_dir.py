"""Where a discovered vLLM pod's stat-logger plugin sends: ``<dir>/<pod uid>/vllm.sock``.

A node agent cannot know a discovered pod's socket from its config (pods are ``namespace/pod`` with
random suffixes), so the socket is named by the one identity both sides know without asking anyone:
the pod's UID. The engine pod mounts the node's directory (a ``hostPath``) with ``subPathExpr:
$(POD_UID)`` (the downward API's ``metadata.uid``) at ``/run/kvwatch``, so the plugin's default
``/run/kvwatch/vllm.sock`` lands in ``<dir>/<uid>/`` on the node and the engine sees no other pod's
socket. The kubelet creates that subdirectory before the pod's containers start; it is also the
pod's opt-in: the agent binds a socket only for a discovered replica whose directory exists, so no
socket (and no reader thread) is made for an engine that does not run the plugin.

Why not an annotation naming the socket: the agent in the discovery overlay runs as UID 0, and a
path any pod author could write would let them make it bind (and replace stale sockets) anywhere.
A UID is checked to be one (the API server generates RFC 4122 UUIDs), so it can never climb out of
the directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

SOCKET_NAME = "vllm.sock"
#: the API server's pod UIDs: ``uuid.NewUUID()`` in apimachinery's ``FillObjectMetaSystemFields``
_UID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def socket_path(directory: str, uid: str) -> str | None:
    """The socket of the pod with ``uid``; None for a UID that is not a UUID (never a path)."""
    if not _UID.match(uid):
        return None
    return os.path.join(directory, uid, SOCKET_NAME)


def plugin_sockets(directory: str, pods: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """(replica, socket path) for each (replica, pod uid) whose pod directory exists, by replica."""
    out = []
    for replica, uid in pods:
        path = socket_path(directory, uid)
        if path is not None and os.path.isdir(os.path.dirname(path)):
            out.append((replica, path))
    return tuple(sorted(out))
