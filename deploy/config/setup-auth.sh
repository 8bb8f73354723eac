#!/bin/sh
# Least-privilege etcd users for chanwatch (docs/OPERATING.md, "etcd users and roles"), on the TLS
# cluster of etcd-{1,2,3}.yml. Run once, as an etcd admin, before `auth enable`.
# ROOT is chanwatch's --root. Each `user add` asks for a password.
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
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/session/node/"
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/channel/"
etcdctl role grant-permission chanwatch-node --prefix=true readwrite "$ROOT/worker/checkpoint/"
etcdctl role add chanwatch-ctl
etcdctl role grant-permission chanwatch-ctl --prefix=true read "$ROOT/"
for part in coord node ctl; do
  etcdctl user add "chanwatch-$part"
  etcdctl user grant-role "chanwatch-$part" "chanwatch-$part"
done
etcdctl user add root
etcdctl user grant-role root root
etcdctl auth enable
