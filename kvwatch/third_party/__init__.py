"""Code that is not kvwatch's to edit: upstream ``.proto`` files and the modules protoc generates from them.

``client_model/`` is Prometheus's exposition data model (vendored with its licence);
``podresources_v1/`` is the kubelet's PodResources v1 API (``scripts/gen-podresources.sh``). Lint,
type, dead-code and duplicate checks pass over the generated modules; regenerate them, never edit.
"""
