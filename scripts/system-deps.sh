#!/usr/bin/env bash
# What the real-process tests need beyond Python: nginx (the L7 path's parity and
# end-to-end tests run a real nginx), a C compiler (the CPU engine builds its C
# kernels at first use) and Prometheus (the observability tests scrape real replicas;
# they start their own instance, never the package's service). Installs what is missing when it can (root with apt-get,
# as on CI and a fresh Debian machine); otherwise says which tests will skip.
# Called by `make test`; never fails the build on its own.
set -uo pipefail
missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v "${CC:-cc}" >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
((${#missing[@]})) || exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${missing[*]} (apt-get)"
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
    exit 0
  fi
  echo "system-deps: apt-get failed"
fi
echo "system-deps: missing ${missing[*]}: install them (e.g. 'sudo apt-get install ${missing[*]}')."
echo "system-deps: until then the tests that need them are skipped; pytest lists them at the start and the end."
exit 0
