//! Integration tests of the node runtime: against a real etcd (started by
//! `chanwatch-testkit` on loopback ports, killed at the end of each test), and the
//! `embed_node` example on the embedded store.

mod checkpoints;
mod consumer;
mod example;
mod exec;
mod liveness;
mod metrics;
mod rounds;
