//! The embedded store's open watches, indexed so a commit costs what it delivers.
//!
//! Owns: the watchers, their index by prefix (a key reaches only the watches whose prefix it
//! starts with: one hash lookup per distinct prefix length, not a scan of every watcher), the
//! few key-range watches (`KeyRange::between`, scanned), and which client opened each watch,
//! for progress notifications.
//!
//! Progress follows etcd: etcd answers a progress request on the watch stream it came on, so
//! only that client's watches hear of it. The embedded store treats a lease renewal as such a
//! request from the client that renewed ([`Watchers::progress`]); handles made by
//! [`super::EmbeddedStore::client`] are separate clients, clones share one. With 1,000 nodes
//! each on a client of its own, a renewal costs one or two messages, not one per watcher
//! (1,000 renewals × 1,000 watchers grew with nodes² and starved the process at 1,000,000
//! channels).
//!
//! Must not: read or change keys, leases or history (the state does), nor block: every send
//! is to an unbounded queue.

use std::collections::{BTreeMap, HashMap};

use tokio::sync::mpsc;

use crate::error::StoreResult;
use crate::types::{KeyRange, Revision, WatchBatch, WatchEvent};

/// Which handle family (see [`super::EmbeddedStore::client`]) opened a watch.
pub(super) type ClientId = u64;

/// One open watch.
#[derive(Debug)]
pub(super) struct Watcher {
    pub(super) keys: KeyRange,
    /// Events below this revision are not sent (a watch from a future revision).
    pub(super) start_revision: Revision,
    /// Every event of the range up to this revision has been sent (events or progress).
    pub(super) delivered: Revision,
    pub(super) client: ClientId,
    pub(super) tx: mpsc::UnboundedSender<StoreResult<WatchBatch>>,
}

/// The open watches and their indexes. Watch ids grow with creation, so iterating in id
/// order serves watches in the order they were opened, as the unindexed list did.
#[derive(Debug, Default)]
pub(super) struct Watchers {
    next_id: u64,
    all: BTreeMap<u64, Watcher>,
    /// Prefix watches by their prefix.
    by_prefix: HashMap<String, Vec<u64>>,
    /// How many prefixes of each length `by_prefix` holds: a key is looked up once per length.
    prefix_lengths: BTreeMap<usize, usize>,
    /// Key-range watches (`start <= key < end`), checked one by one.
    ranged: Vec<u64>,
    by_client: HashMap<ClientId, Vec<u64>>,
    /// Size after the last sweep of closed watches: the next sweep comes when it doubles.
    swept_at: usize,
}

impl Watchers {
    /// Registers a watch.
    pub(super) fn add(&mut self, w: Watcher) {
        if self.all.len() >= 2 * self.swept_at.max(64) {
            self.sweep();
        }
        let id = self.next_id;
        self.next_id += 1;
        match w.keys.end() {
            None => {
                let prefix = w.keys.start().to_owned();
                *self.prefix_lengths.entry(prefix.len()).or_default() += 1;
                self.by_prefix.entry(prefix).or_default().push(id);
            }
            Some(_) => self.ranged.push(id),
        }
        self.by_client.entry(w.client).or_default().push(id);
        self.all.insert(id, w);
    }

    /// Ends every watch (their streams end).
    pub(super) fn clear(&mut self) {
        *self = Watchers {
            next_id: self.next_id,
            ..Watchers::default()
        };
    }

    /// Number of open watches (closed ones may count until the next send to them or sweep).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.all.len()
    }

    fn remove(&mut self, id: u64) {
        let Some(w) = self.all.remove(&id) else {
            return;
        };
        let drop_id = |ids: &mut Vec<u64>| ids.retain(|i| *i != id);
        match w.keys.end() {
            None => {
                let prefix = w.keys.start();
                if let Some(ids) = self.by_prefix.get_mut(prefix) {
                    drop_id(ids);
                    if ids.is_empty() {
                        self.by_prefix.remove(prefix);
                    }
                }
                if let Some(n) = self.prefix_lengths.get_mut(&prefix.len()) {
                    *n -= 1;
                    if *n == 0 {
                        self.prefix_lengths.remove(&prefix.len());
                    }
                }
            }
            Some(_) => drop_id(&mut self.ranged),
        }
        if let Some(ids) = self.by_client.get_mut(&w.client) {
            drop_id(ids);
            if ids.is_empty() {
                self.by_client.remove(&w.client);
            }
        }
    }

    /// Drops every watch whose receiver is gone.
    fn sweep(&mut self) {
        let closed: Vec<u64> = self
            .all
            .iter()
            .filter(|(_, w)| w.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in closed {
            self.remove(id);
        }
        self.swept_at = self.all.len();
    }

    /// Sends revision `rev`'s events to each watch whose range holds any of them, as one batch
    /// per watch, in event order.
    pub(super) fn deliver(&mut self, rev: Revision, events: &[WatchEvent]) {
        let mut matched: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (i, e) in events.iter().enumerate() {
            let key = e.kv.key.as_str();
            for &len in self.prefix_lengths.keys() {
                if len > key.len() {
                    break;
                }
                if !key.is_char_boundary(len) {
                    continue;
                }
                if let Some(ids) = self.by_prefix.get(&key[..len]) {
                    for id in ids {
                        matched.entry(*id).or_default().push(i);
                    }
                }
            }
            for id in &self.ranged {
                if self.all.get(id).is_some_and(|w| w.keys.contains(key)) {
                    matched.entry(*id).or_default().push(i);
                }
            }
        }
        let mut gone = Vec::new();
        for (id, idx) in matched {
            let Some(w) = self.all.get_mut(&id) else {
                continue;
            };
            if rev < w.start_revision {
                continue;
            }
            let batch = idx.into_iter().map(|i| events[i].clone()).collect();
            w.delivered = rev;
            if w.tx.send(Ok(WatchBatch::of_events(batch))).is_err() {
                gone.push(id);
            }
        }
        for id in gone {
            self.remove(id);
        }
    }

    /// A progress notification at `rev` to each of `client`'s watches that has not been told
    /// of it yet (etcd answers a progress request likewise, on the stream that asked).
    pub(super) fn progress(&mut self, client: ClientId, rev: Revision) {
        let Some(ids) = self.by_client.get(&client) else {
            return;
        };
        let mut gone = Vec::new();
        for id in ids {
            let Some(w) = self.all.get_mut(id) else {
                continue;
            };
            if w.delivered < rev && rev >= w.start_revision {
                w.delivered = rev;
                if w.tx.send(Ok(WatchBatch::progress(rev))).is_err() {
                    gone.push(*id);
                }
            }
        }
        for id in gone {
            self.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{EventKind, KeyValue};

    type Rx = mpsc::UnboundedReceiver<StoreResult<WatchBatch>>;

    fn watch(ws: &mut Watchers, keys: KeyRange, client: ClientId) -> Rx {
        let (tx, rx) = mpsc::unbounded_channel();
        ws.add(Watcher {
            keys,
            start_revision: 1,
            delivered: 0,
            client,
            tx,
        });
        rx
    }

    fn put(key: &str, rev: Revision) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Put,
            kv: KeyValue {
                key: key.to_owned(),
                value: b"v".to_vec(),
                create_revision: rev,
                mod_revision: rev,
                version: 1,
                lease: None,
            },
        }
    }

    fn keys_of(rx: &mut Rx) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        while let Ok(Ok(b)) = rx.try_recv() {
            out.push(b.events.into_iter().map(|e| e.kv.key).collect());
        }
        out
    }

    #[test]
    fn an_event_reaches_exactly_the_watches_whose_range_holds_its_key() {
        let mut ws = Watchers::default();
        let mut a = watch(&mut ws, KeyRange::prefix("r/channel/1/"), 0);
        let mut a2 = watch(&mut ws, KeyRange::prefix("r/channel/1/"), 0);
        let mut b = watch(&mut ws, KeyRange::prefix("r/channel/10/"), 0);
        let mut all = watch(&mut ws, KeyRange::prefix("r/"), 0);
        let mut range = watch(&mut ws, KeyRange::between("r/channel/1", "r/channel/2"), 0);
        let mut other = watch(&mut ws, KeyRange::prefix("s/"), 0);
        let mut empty = watch(&mut ws, KeyRange::prefix(""), 0);
        let events = [
            put("r/channel/1/x", 2),
            put("r/channel/10/y", 2),
            put("r/channel/2/z", 2),
        ];
        ws.deliver(2, &events);
        assert_eq!(keys_of(&mut a), [vec!["r/channel/1/x"]]);
        assert_eq!(keys_of(&mut a2), [vec!["r/channel/1/x"]]);
        assert_eq!(keys_of(&mut b), [vec!["r/channel/10/y"]]);
        assert_eq!(
            keys_of(&mut all),
            [vec!["r/channel/1/x", "r/channel/10/y", "r/channel/2/z"]]
        );
        assert_eq!(
            keys_of(&mut range),
            [vec!["r/channel/1/x", "r/channel/10/y"]]
        );
        assert!(keys_of(&mut other).is_empty());
        assert_eq!(
            keys_of(&mut empty).len(),
            1,
            "the empty prefix holds every key"
        );
    }

    #[test]
    fn progress_reaches_only_the_renewing_clients_watches_that_are_behind() {
        let mut ws = Watchers::default();
        let mut mine = watch(&mut ws, KeyRange::prefix("a/"), 1);
        let mut theirs = watch(&mut ws, KeyRange::prefix("a/"), 2);
        ws.progress(1, 5);
        ws.progress(1, 5);
        let got: Vec<Revision> = std::iter::from_fn(|| mine.try_recv().ok())
            .filter_map(Result::ok)
            .map(|b| b.revision)
            .collect();
        assert_eq!(got, [5], "once per revision, to the client that renewed");
        assert!(
            theirs.try_recv().is_err(),
            "another client's watch hears nothing"
        );
    }

    #[test]
    fn closed_watches_are_dropped_from_every_index() {
        let mut ws = Watchers::default();
        let a = watch(&mut ws, KeyRange::prefix("a/"), 1);
        let mut b = watch(&mut ws, KeyRange::prefix("a/"), 1);
        drop(a);
        ws.deliver(2, &[put("a/k", 2)]);
        assert_eq!(ws.len(), 1);
        assert_eq!(keys_of(&mut b), [vec!["a/k"]]);
        drop(b);
        ws.progress(1, 3);
        assert_eq!(ws.len(), 0);
        assert!(ws.by_prefix.is_empty() && ws.prefix_lengths.is_empty());
        assert!(ws.by_client.is_empty());
    }
}
