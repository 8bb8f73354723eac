//! Integration tests of the test fixtures themselves, against a real etcd and nats-server;
//! with feature `inproc`, of the in-process cluster harness.

mod grpc_proxy;
#[cfg(feature = "inproc")]
mod inproc;
mod nats;
