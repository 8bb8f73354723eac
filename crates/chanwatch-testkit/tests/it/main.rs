//! Integration tests of the test fixtures themselves, against a real etcd.

mod grpc_proxy;
