"""Replicas and GPU owners found at run time: Kubernetes pods on this node, the kubelet's GPU grants.

``pods.py`` decides from a pod object whether it is an engine and where its metrics are (pure);
``kube_api.py`` lists and watches this node's pods through the API server; ``podresources.py``
asks the kubelet which containers hold which GPUs. The agent turns both into replicas and labels.
"""
