#!/usr/bin/env bash
# Fill .netbin/ with this machine's iproute2 (ip, tc) and etcd, with the libraries they load beyond the C library,
# for experiments/capped_link_gpu.sh on a GPU image that lacks them (it puts .netbin/bin last on PATH: the image's
# own win where it has them). Carry .netbin beside .whl; ~10 MB (etcd gzipped:
# the runner unpacks it). Run here: bash experiments/netbin.sh
# ip and tc run through wrappers that give only them the carried libraries: what `ip netns exec NS CMD` starts
# gets the caller's LD_LIBRARY_PATH back, so no process of pushkv loads a carried library.
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.netbin/' "$EXCLUDE" 2>/dev/null || echo '/.netbin/' >> "$EXCLUDE"
rm -rf .netbin && mkdir -p .netbin/bin .netbin/real .netbin/lib
gzip -9c "$(command -v etcd || echo /usr/bin/etcd)" > .netbin/etcd.gz  # 21 MB -> 8: the tree travels capped
for b in ip tc; do
  path=$(command -v $b); cp -L "$path" .netbin/real/
  { ldd "$path" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt)\.so' || true; } \
    | xargs -r -I{} cp -L {} .netbin/lib/
  cat > .netbin/bin/$b <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/..
if [ "$b" = ip ] && [ "\${1:-}" = netns ] && [ "\${2:-}" = exec ] && [ \$# -ge 4 ]; then
  ns=\$3; shift 3
  if [ -n "\${LD_LIBRARY_PATH:-}" ]; then set -- env LD_LIBRARY_PATH="\$LD_LIBRARY_PATH" "\$@"; else set -- env -u LD_LIBRARY_PATH "\$@"; fi
  set -- netns exec "\$ns" "\$@"
fi
LD_LIBRARY_PATH=\$here/lib exec "\$here/real/$b" "\$@"
WRAP
  chmod +x .netbin/bin/$b
done
du -sh .netbin; ls .netbin/bin .netbin/lib
