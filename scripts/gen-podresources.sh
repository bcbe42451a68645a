#!/bin/sh
# Regenerate the committed gRPC stubs of the kubelet's PodResources v1 API from api.proto (with the
# message types in api_pb2.pyi, so mypy sees the generated messages).
# Needs grpcio-tools (pip install grpcio-tools); tests/discovery/test_podresources.py checks that
# the committed stubs are what this produces.
set -eu
cd "$(dirname "$0")/.."
out=${1:-kvwatch/third_party/podresources_v1}
"${PYTHON:-python3}" -m grpc_tools.protoc -I kvwatch/third_party/podresources_v1 --python_out="$out" \
  --pyi_out="$out" --grpc_python_out="$out" kvwatch/third_party/podresources_v1/api.proto
# the generated service module imports its messages as a top-level module; make it package-relative
sed -i 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' "$out/api_pb2_grpc.py"
