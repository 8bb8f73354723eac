//! Integration tests of the node runtime against a real etcd (started by
//! `chanwatch-testkit` on loopback ports, killed at the end of each test).

mod liveness;
