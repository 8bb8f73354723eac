#!/bin/sh
# Least-privilege etcd users for chanwatch (docs/OPERATING.md, "etcd users and roles"), on the TLS
# cluster of etcd-{1,2,3}.yml. Run once, as an etcd admin, before `auth enable`.
# ROOT is chanwatch's --root. Each `user add` asks for a password.
# NODES="name:block ...": one etcd user per node name (NodeRestriction, docs/OPERATING.md "One
# etcd user per node"), bound to the ID block (0-999) reserved for that name: the node run with
# `--name NAME --etcd-user chanwatch-node-NAME` can write its own session, acknowledgements and
# ID counter, and no other node's. Example: NODES="chanwatch-node-0:0 chanwatch-node-1:1".
# Without NODES, the shared chanwatch-node user below lets every node write every node's keys.
set -eu
ROOT=${ROOT:-chanwatch}
export ETCDCTL_API=3
export ETCDCTL_ENDPOINTS=${ETCDCTL_ENDPOINTS:-https://etcd-1.example.internal:2379,https://etcd-2.example.internal:2379,https://etcd-3.example.internal:2379}
export ETCDCTL_CACERT=${ETCDCTL_CACERT:-/etc/chanwatch/tls/ca.pem}
export ETCDCTL_CERT=${ETCDCTL_CERT:-/etc/chanwatch/tls/client.pem}
export ETCDCTL_KEY=${ETCDCTL_KEY:-/etc/chanwatch/tls/client-key.pem}

etcdctl role add chanwatch-coord
etcdctl role grant-permission chanwatch-coord --prefix=true read      "$ROOT/"
etcdctl role grant-permission chanwatch-coord --prefix=true readwrite "$ROOT/coord/"
etcdctl role grant-permission chanwatch-coord --prefix=true readwrite "$ROOT/channel/"
etcdctl role grant-permission chanwatch-coord --prefix=true readwrite "$ROOT/worker/checkpoint/"
etcdctl role add chanwatch-node
etcdctl role grant-permission chanwatch-node readwrite "$ROOT/id/node"
etcdctl role grant-permission chanwatch-node --prefix=true read "$ROOT/id/name/" # skips reserved blocks' IDs
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/session/node/"
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/channel/"
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/worker/checkpoint/"
etcdctl role add chanwatch-ctl
etcdctl role grant-permission chanwatch-ctl --prefix=true read "$ROOT/"
for part in coord node ctl; do
  etcdctl user add "chanwatch-$part"
  etcdctl user grant-role "chanwatch-$part" "chanwatch-$part"
done
for entry in ${NODES:-}; do
  name=${entry%:*}
  block=${entry##*:}
  case "$block" in
    ''|*[!0-9]*) echo "NODES entry $entry: the block must be a number 0-999" >&2; exit 1 ;;
  esac
  [ "$block" -le 999 ] || { echo "NODES entry $entry: the block must be 0-999" >&2; exit 1; }
  ids=$(printf '1%03d' "$block")   # every ID of block B starts with 1 and B in three digits
  role="chanwatch-node-$name"
  etcdctl role add "$role"
  etcdctl role grant-permission "$role" read "$ROOT/id/node"             # the connection check
  etcdctl role grant-permission "$role" read "$ROOT/id/name/$name"       # its block's number
  etcdctl role grant-permission "$role" readwrite "$ROOT/id/block/$(printf '%03d' "$block")"
  etcdctl role grant-permission "$role" --prefix=true readwrite "$ROOT/session/node/$ids"
  etcdctl role grant-permission "$role" --prefix=true readwrite "$ROOT/channel/$ids"
  # Checkpoints are keyed by channel, not by node: not restricted yet (docs/OPERATING.md).
  etcdctl role grant-permission "$role" --prefix=true readwrite "$ROOT/worker/checkpoint/"
  etcdctl user add "$role"
  etcdctl user grant-role "$role" "$role"
  etcdctl put "$ROOT/id/name/$name" "$block"
done
etcdctl user add root
etcdctl user grant-role root root
etcdctl auth enable
