//! Integration tests of the test fixtures themselves, against a real etcd and nats-server.

mod grpc_proxy;
mod nats;
