#!/usr/bin/env bash
# Install pushkv and everything it needs into ./.venv, from nothing.
#
# torch is installed first, on its own, so that nixl's torch requirement is already
# met and pulls nothing. Which build (README "Install"):
#   PUSHKV_TORCH=cpu   (default) torch==$PUSHKV_TORCH_VERSION+cpu, the CPU-only wheel: from a
#                      source pip is already configured with (a local wheel directory, a
#                      mirror), else from the PyTorch CPU index. Never a CUDA build: the
#                      "+cpu" local version exists only there.
#   PUSHKV_TORCH=cuda  torch==$PUSHKV_TORCH_VERSION as PyPI ships it for Linux x86-64 (a CUDA
#                      build, several GB with its nvidia-* wheels); PUSHKV_TORCH_INDEX picks
#                      another CUDA build, e.g. https://download.pytorch.org/whl/cu130
#   PUSHKV_TORCH=keep  use the torch already in the venv (or fail if there is none)
#   PUSHKV_TORCH_VERSION  default 2.13.0
#   PUSHKV_TORCH_INDEX    for cpu: the index to fetch the +cpu wheel from when pip's own
#                         configuration has none (default https://download.pytorch.org/whl/cpu)
#   PYTHON                the interpreter for the venv (default python3; needs >= 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${PUSHKV_TORCH:-cpu}
VER=${PUSHKV_TORCH_VERSION:-2.13.0}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "pushkv needs Python >= 3.11 (tomllib, asyncio.timeout); $("$PY" -V 2>&1) found. Set PYTHON=python3.11 or newer." >&2
  exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade pip >/dev/null
case "$TORCH" in
  cpu)
    if [ -n "${PUSHKV_TORCH_INDEX:-}" ]; then
      "${PIP[@]}" install -q --extra-index-url "$PUSHKV_TORCH_INDEX" "torch==$VER+cpu"
    elif ! "${PIP[@]}" install -q "torch==$VER+cpu" 2>/dev/null; then
      echo "no configured pip source has torch $VER+cpu; fetching it from the PyTorch CPU index" >&2
      "${PIP[@]}" install -q --extra-index-url https://download.pytorch.org/whl/cpu "torch==$VER+cpu"
    fi ;;
  cuda)
    "${PIP[@]}" install -q ${PUSHKV_TORCH_INDEX:+--index-url "$PUSHKV_TORCH_INDEX"} "torch==$VER" ;;
  keep) .venv/bin/python -c "import torch" 2>/dev/null || {
          echo "PUSHKV_TORCH=keep: .venv has no torch to keep (install one into it, or use PUSHKV_TORCH=cpu|cuda)" >&2
          exit 2; } ;;
  *) echo "PUSHKV_TORCH must be cpu, cuda or keep (got '$TORCH')" >&2; exit 2 ;;
esac
"${PIP[@]}" install -q -e ".[test,bench]"
# System tools for several hosts (README "Several hosts"): etcd, the registry, which the tests
# start for real (Debian's etcd-server, 3.4), and iproute2's `ip` for the network-namespace
# "hosts" (and openssl for a test CA). Installed with apt-get when missing and we are root; otherwise say what to install.
missing=()
[ -x /usr/bin/etcd ] || command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the TLS registry test makes a throwaway CA
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # never fatal: without them the registry and multi-host tests skip, saying why
    { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
      || echo "pushkv: apt-get could not install ${missing[*]}: the etcd and multi-host tests will skip" >&2
  else
    echo "pushkv: missing ${missing[*]}: the etcd registry and the multi-host tests need them;" \
         "install with: sudo apt-get install ${missing[*]}" >&2
  fi
fi
.venv/bin/python - "$TORCH" <<'PYEOF'
import sys
import torch, nixl._api, zmq, msgspec, aiohttp  # noqa: F401
want = sys.argv[1]
cuda = torch.version.cuda
if want == "cpu" and cuda:
    sys.exit(f"asked for the CPU build, got torch {torch.__version__} (CUDA {cuda})")
print(f"pushkv deps ok: torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU only'})")
PYEOF
