"""Prometheus's exposition data model, ``io/prometheus/client/metrics.proto``, vendored.

From github.com/prometheus/client_model at 10dc9dfb541a117fe0a6457192564ec609c78615 (Apache-2.0:
``LICENSE`` and ``NOTICE`` here). ``metrics_pb2.py``/``.pyi`` are generated, not edited; regenerate
from this folder's ``metrics.proto`` with the test extras' grpcio-tools::

    mkdir -p /tmp/cm/io/prometheus/client && cp metrics.proto /tmp/cm/io/prometheus/client/
    cd /tmp/cm && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \\
        io/prometheus/client/metrics.proto
    cp io/prometheus/client/metrics_pb2.py* <this folder>

(the file is compiled under its upstream path so it registers as ``io/prometheus/client/metrics.proto``
in the protobuf descriptor pool, like every other client's copy).
"""
