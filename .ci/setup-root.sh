#!/usr/bin/env bash
# Debian packages that tests need: iproute2 (`ip netns`, for tests/system/test_partition.py),
# systemd-container (`systemd-nspawn`, for tests/system/test_systemd.py), prometheus (for its
# `promtool`, which checks the shipped alert rules and the dashboard's queries in
# tests/unit/test_packaging_metrics.py), nftables (`nft`, for the store's owner rule in
# tests/chaos/test_store_freeze.py), etcd-server (/usr/bin/etcd, which the etcd store's
# tests start themselves: tests/fixtures/etcd.py), zsh (elasticctl's zsh completion,
# driven in tests/integration/test_completion_shells.py), debootstrap (the fresh Debian 13
# host of tests/system/test_deb.py) and slurmd, slurmctld, slurm-client and munge (the Slurm
# cluster on test hosts of tests/system/test_slurm.py; their services are not started: the
# test runs its own daemons, with its own config and munge key).
# Idempotent and quiet; does nothing (exit 0) when not root or when all are installed.
# The tests skip themselves without them (the etcd and zsh ones fail instead when CI is set).
set -euo pipefail
packages=(iproute2 systemd-container prometheus nftables etcd-server zsh debootstrap
  slurmd slurmctld slurm-client munge)
[ "$(id -u)" -eq 0 ] || exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# Only their programs are wanted (promtool, etcd, Slurm's): no package may start its service
# while being installed.
guard=
if [ ! -e /usr/sbin/policy-rc.d ]; then
  guard=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\nexit 101\n' > "$guard"
  chmod +x "$guard"
fi
trap 'rm -f "$log" ${guard:+"$guard"}' EXIT
# quiet unless something fails; then show apt's own words
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2; exit 1
fi
