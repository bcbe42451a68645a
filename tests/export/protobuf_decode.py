"""Reading a protobuf exposition back into MetricFamily messages, for the tests that check what the
protobuf encoder wrote (its samples, its native buckets, the profiles' folded series)."""

from __future__ import annotations

from google.protobuf.internal.decoder import _DecodeVarint  # type: ignore[attr-defined]

from kvwatch.third_party.client_model import metrics_pb2 as pb


def decode(body: bytes) -> list[pb.MetricFamily]:
    families, pos = [], 0
    while pos < len(body):
        size, pos = _DecodeVarint(body, pos)
        family = pb.MetricFamily()
        family.ParseFromString(body[pos : pos + size])
        families.append(family)
        pos += size
    return families
