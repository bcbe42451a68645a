"""Capacity planning from a node's own traffic (``kvwatch plan``, docs/planning.md).

``fit``: the step-time fit (pure). ``sources``/``prometheus``: where calibration data comes from.
``calibration``: the calibration file. ``inputs``: ledger or trace -> requests. ``candidate``: a
deployment to try. ``replay``: the twin run. ``compare``: the candidate sweep against SLOs.
``render``: text and HTML. ``export``: ledger -> Mooncake JSONL.
"""
