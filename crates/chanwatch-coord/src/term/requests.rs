//! The term's side of the handle's requests: each [`Request`] served between two turns of the
//! leader's loop — reads of the view, admin commands the planner turns into txns, written
//! through the one write path ([`crate::execute::sends`]).
//!
//! Owns: dispatching a request and answering it. Must not: decide (the planner does) or
//! write except through the write path.

use std::sync::Arc;

use chanwatch_core::planner::{AdminError, PlannedTxn, Transition};
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::Term;
use crate::handle::{ApiError, Request};

impl Term<'_> {
    /// Handles an admin request. `Err` only when leadership was lost.
    pub(super) async fn handle(&mut self, req: Request) -> Result<(), String> {
        let now = self.clock.unix_ms();
        match req {
            Request::Channels(reply) => drop(reply.send(Ok(self.state.channel_rows()))),
            Request::Nodes(reply) => drop(reply.send(Ok(self.state.node_rows()))),
            Request::Add { name, reply, .. } | Request::AddPlaced { name, reply, .. }
                if self.bulk.holds(&name) =>
            {
                drop(reply.send(Err(AdminError::AlreadyExists(name).into())));
            }
            Request::Add {
                name,
                vchannel,
                reply,
            } => {
                let planned = self.state.add_channel(name, vchannel, now);
                self.run_one(planned, reply).await?;
            }
            Request::Remove { name, reply } => {
                let planned = self.state.remove_channel(&name);
                self.run_one(planned, reply).await?;
            }
            Request::Move { name, to, reply } => {
                let planned = self.state.move_channel(&name, to, now);
                self.run_one(planned, reply).await?;
            }
            Request::Drain { node, reply } => {
                let planned = self.state.drain(node);
                let (tx, rx) = oneshot::channel();
                self.run_one(planned, tx).await?;
                let result = match rx.await {
                    Ok(Ok(_)) => {
                        info!(node = %node, "coord: draining node");
                        Ok(())
                    }
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(ApiError::Store("drain request dropped".into())),
                };
                drop(reply.send(result));
                self.replan = true;
            }
            Request::Balance { dry_run, reply } => {
                let plan = self.state.balance_plan();
                drop(reply.send(Ok(plan)));
                if !dry_run {
                    // Runs even with --auto-balance=false, until balanced.
                    self.state.ask_balance();
                    self.replan = true;
                }
            }
            Request::AddPlaced {
                name,
                vchannel,
                placement,
                reply,
            } => {
                let planned = self.state.add_channel_with(name, vchannel, placement, now);
                self.run_one(planned, reply).await?;
            }
            Request::Pin {
                name,
                pinned,
                reply,
            } => {
                match self.state.set_pinned(&name, pinned) {
                    // Already so: nothing to write.
                    Ok(t) if t.ops.is_empty() => drop(reply.send(Ok(Vec::new()))),
                    planned => self.run_one(planned, reply).await?,
                }
            }
            Request::View(read) => (read.0)(Ok(&self.state)),
            Request::Undrain { node, reply } => self.undrain(node, reply).await?,
            Request::AddMany { infos, reply } => self.add_many(infos, reply),
        }
        Ok(())
    }

    pub(crate) async fn run_one(
        &mut self,
        planned: Result<PlannedTxn, AdminError>,
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    ) -> Result<(), String> {
        let txn = match planned {
            Ok(t) => t,
            Err(e) => {
                drop(reply.send(Err(e.into())));
                return Ok(());
            }
        };
        let mut send =
            crate::execute::sends(self.store.clone(), Arc::new(self.encoder()), vec![txn]);
        let Some(one) = send.next() else {
            return Ok(()); // one txn in, one send out
        };
        let (txn, result, started) = one.await;
        self.record_txn(&result, started, txn.ops.len() <= crate::execute::PACE_OPS);
        match result {
            Ok(r) if r.succeeded => {
                self.state.applied(&txn, r.revision);
                self.log_transitions(&txn);
                drop(reply.send(Ok(txn.transitions)));
                Ok(())
            }
            Ok(r) => {
                self.refresh(&txn, &r)?;
                drop(reply.send(Err(ApiError::Store(
                    "the channel changed meanwhile; retry".into(),
                ))));
                Ok(())
            }
            Err(e) => {
                // The asker hears it (503), and so does the operator of this process: a
                // newcomer's leader whose credentials etcd refused logged nothing at all.
                warn!(error = %e, channels = txn.transitions.len(), "coord: the txn of an admin request failed; answered 503 (the asker may retry)");
                drop(reply.send(Err(ApiError::Store(e.to_string()))));
                Ok(())
            }
        }
    }
}
