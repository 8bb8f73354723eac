//! The embedded log: one append-only file per channel under a data dir, no server.
//!
//! Owns: the data dir's files, an in-memory index of each channel's record offsets,
//! recovery of a torn last record, and waking readers. Must not: know etcd, keys or
//! checkpoints.
//!
//! * **Files**: `{dir}/{channel}.log`, a sequence of records `len: u32 LE`, `crc: u32 LE`,
//!   `payload` (`len` bytes), `crc` being CRC-32 (IEEE) over the length bytes and the payload
//!   (so zeros never pass as a record).
//!
//! * **Position** = the record's 1-based index in its file, so positions are dense and
//!   survive a restart (they are recomputed by scanning the file when a process first touches
//!   the channel).
//! * **Durability** ([`FsyncPolicy`]): an append that returned was written to the file
//!   (`write(2)`), so it survives the crash of this process (`kill -9`). With
//!   [`FsyncPolicy::Never`] (the default) a crash of the machine may lose the last appends;
//!   with [`FsyncPolicy::EveryAppend`] `fdatasync` runs before `append` returns (and the
//!   dir is synced when a channel's file is created).
//! * **Crash recovery**: a last record cut off by a crash (short, bad checksum, or zeros) is
//!   skipped by readers and truncated by the first append to that channel (logged as a
//!   warning). Damage *before* the last record is [`LogError::Corrupt`], never skipped.
//! * **Processes**: any number of processes may read a dir; **one process at a time appends
//!   to a channel** (e.g. a producer; nothing enforces it: two appending processes would
//!   hand out the same position twice). Readers in other processes see new records within
//!   [`FileLogOptions::poll_interval`]; in this process an append wakes readers at once.
//! * **Memory**: 8 bytes per message of each channel touched (the offset index).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use crate::record::{self, Tail};
use crate::{check_channel, Log, LogError, LogResult, Message, Position, MAX_MESSAGE_BYTES};

/// When the file log forces appends to the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsyncPolicy {
    /// Never: the OS writes back when it likes. An append survives a process crash, not
    /// necessarily a machine crash. Fast; the default (standalone, demo, tests).
    #[default]
    Never,
    /// `fdatasync` before each append returns: survives a machine crash. One disk flush per
    /// message.
    EveryAppend,
}

/// Settings of a [`FileLog`].
#[derive(Debug, Clone)]
pub struct FileLogOptions {
    /// See [`FsyncPolicy`].
    pub fsync: FsyncPolicy,
    /// How often a waiting read looks at the file for appends made by another process
    /// (appends in this process wake it at once). Default 50 ms.
    pub poll_interval: Duration,
}

impl Default for FileLogOptions {
    fn default() -> Self {
        FileLogOptions {
            fsync: FsyncPolicy::Never,
            poll_interval: Duration::from_millis(50),
        }
    }
}

/// The embedded log over a data dir. See the module docs for positions, durability and
/// crash recovery.
#[derive(Debug)]
pub struct FileLog {
    dir: PathBuf,
    options: FileLogOptions,
    channels: Mutex<HashMap<String, Arc<Channel>>>,
}

/// One channel's file and index.
#[derive(Debug)]
struct Channel {
    path: PathBuf,
    fsync: FsyncPolicy,
    state: Mutex<Index>,
    /// Bumped after every append in this process; readers wait on it.
    appended: watch::Sender<u64>,
}

/// What this process knows of a channel file. Invariant: `starts` are the offsets of the
/// good records in `0..end`, in order.
#[derive(Debug, Default)]
struct Index {
    /// For reading; `None` until the file exists.
    reader: Option<File>,
    /// For appending; opened (after recovering the tail) by the first append.
    writer: Option<File>,
    starts: Vec<u64>,
    end: u64,
}

impl FileLog {
    /// Opens (creating it if needed) the data dir `dir`. Channel files are read lazily, when a
    /// call first names the channel.
    ///
    /// # Errors
    /// [`LogError::Io`] when the dir cannot be created.
    pub fn open(dir: impl AsRef<Path>, options: FileLogOptions) -> LogResult<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|source| LogError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(FileLog {
            dir,
            options,
            channels: Mutex::new(HashMap::new()),
        })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file holding `channel` (which must be a valid name): `{dir}/{channel}.log`.
    pub fn channel_path(&self, channel: &str) -> PathBuf {
        self.dir.join(format!("{channel}.log"))
    }

    fn channel(&self, name: &str) -> LogResult<Arc<Channel>> {
        check_channel(name)?;
        let mut channels = lock(&self.channels);
        Ok(channels
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Channel {
                    path: self.channel_path(name),
                    fsync: self.options.fsync,
                    state: Mutex::new(Index::default()),
                    appended: watch::Sender::new(0),
                })
            })
            .clone())
    }
}

/// Locks a mutex; a panic while it was held left the data consistent enough to go on (every
/// update of `Index` is a push after a successful write).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> LogResult<T> + Send + 'static,
) -> LogResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| LogError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(format!("file task failed: {e}")),
        })?
}

impl Channel {
    fn io(&self, source: std::io::Error) -> LogError {
        LogError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Brings the index up to the file's current length. Returns the tail it found.
    fn refresh(&self, index: &mut Index) -> LogResult<Tail> {
        if index.reader.is_none() {
            match File::open(&self.path) {
                Ok(f) => index.reader = Some(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Tail::Clean),
                Err(e) => return Err(self.io(e)),
            }
        }
        let Some(reader) = index.reader.as_ref() else {
            return Ok(Tail::Clean);
        };
        let len = reader.metadata().map_err(|e| self.io(e))?.len();
        if len == index.end {
            return Ok(Tail::Clean);
        }
        let found = record::scan(reader, index.end, len).map_err(|e| self.io(e))?;
        index.starts.extend(found.starts);
        index.end = found.end;
        if let Tail::Corrupt(reason) = &found.tail {
            return Err(LogError::Corrupt {
                path: self.path.clone(),
                offset: found.end,
                reason: reason.clone(),
            });
        }
        Ok(found.tail)
    }

    fn append(&self, payload: &[u8]) -> LogResult<Position> {
        let mut index = lock(&self.state);
        let tail = self.refresh(&mut index)?;
        if index.writer.is_none() || tail == Tail::Torn {
            let writer = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .map_err(|e| self.io(e))?;
            let len = writer.metadata().map_err(|e| self.io(e))?.len();
            if len == 0 && self.fsync == FsyncPolicy::EveryAppend {
                // A new file: its directory entry must reach the disk too.
                if let Some(dir) = self.path.parent() {
                    File::open(dir)
                        .and_then(|d| d.sync_all())
                        .map_err(|e| self.io(e))?;
                }
            }
            if len > index.end {
                tracing::warn!(
                    file = %self.path.display(),
                    from = index.end,
                    bytes = len - index.end,
                    "cutting off a torn last record (a crash interrupted its write)"
                );
                writer.set_len(index.end).map_err(|e| self.io(e))?;
                writer.sync_all().map_err(|e| self.io(e))?;
            }
            index.writer = Some(writer);
        }
        let bytes = record::encode(payload);
        let start = index.end;
        let written = match index.writer.as_mut() {
            Some(w) => w.write_all(&bytes).and_then(|()| match self.fsync {
                FsyncPolicy::Never => Ok(()),
                FsyncPolicy::EveryAppend => w.sync_data(),
            }),
            None => Err(std::io::Error::other("no writer")),
        };
        if let Err(e) = written {
            // Leave no partial record behind for the next append to write after.
            if let Some(w) = index.writer.take() {
                let _ = w.set_len(start);
            }
            return Err(self.io(e));
        }
        index.starts.push(start);
        index.end = start + bytes.len() as u64;
        let position = Position::from_raw(index.starts.len() as u64);
        drop(index);
        self.appended.send_modify(|n| *n += 1);
        Ok(position)
    }

    fn read(&self, after: Position, max: usize) -> LogResult<Vec<Message>> {
        let mut index = lock(&self.state);
        self.refresh(&mut index)?;
        let first = usize::try_from(after.raw()).unwrap_or(usize::MAX);
        if first >= index.starts.len() {
            return Ok(Vec::new());
        }
        let last = index.starts.len().min(first.saturating_add(max.max(1)));
        let from = index.starts[first];
        let to = index.starts.get(last).copied().unwrap_or(index.end);
        let Some(reader) = index.reader.as_ref() else {
            return Ok(Vec::new());
        };
        let bytes = Bytes::from(
            record::read_at(reader, from, (to - from) as usize).map_err(|e| self.io(e))?,
        );
        let mut out = Vec::with_capacity(last - first);
        for (i, start) in index.starts[first..last].iter().enumerate() {
            let rel = (start - from) as usize;
            let end = index
                .starts
                .get(first + i + 1)
                .map_or(bytes.len(), |next| (next - from) as usize);
            let payload = record::decode(&bytes[rel..end]).ok_or_else(|| LogError::Corrupt {
                path: self.path.clone(),
                offset: *start,
                reason: "a record changed after it was read (checksum mismatch)".to_owned(),
            })?;
            let offset = rel + record::HEADER;
            debug_assert_eq!(payload.len(), end - offset);
            out.push(Message {
                position: Position::from_raw((first + i + 1) as u64),
                payload: bytes.slice(offset..end),
            });
        }
        Ok(out)
    }

    fn end(&self) -> LogResult<Position> {
        let mut index = lock(&self.state);
        self.refresh(&mut index)?;
        Ok(Position::from_raw(index.starts.len() as u64))
    }
}

#[async_trait]
impl Log for FileLog {
    async fn append(&self, channel: &str, payload: Bytes) -> LogResult<Position> {
        if payload.len() > MAX_MESSAGE_BYTES {
            return Err(LogError::TooLarge {
                bytes: payload.len(),
                max: MAX_MESSAGE_BYTES,
            });
        }
        let ch = self.channel(channel)?;
        let path = ch.path.clone();
        blocking(&path, move || ch.append(&payload)).await
    }

    async fn read(
        &self,
        channel: &str,
        after: Position,
        max: usize,
        wait: Duration,
    ) -> LogResult<Vec<Message>> {
        let ch = self.channel(channel)?;
        let deadline = tokio::time::Instant::now() + wait;
        let mut appended = ch.appended.subscribe();
        loop {
            appended.borrow_and_update();
            let c = ch.clone();
            let batch = blocking(&ch.path, move || c.read(after, max)).await?;
            let now = tokio::time::Instant::now();
            if !batch.is_empty() || now >= deadline {
                return Ok(batch);
            }
            let nap = (deadline - now).min(self.options.poll_interval);
            // Woken by an append here, or look again after a nap (another process's append).
            let _ = tokio::time::timeout(nap, appended.changed()).await;
        }
    }

    async fn end(&self, channel: &str) -> LogResult<Position> {
        let ch = self.channel(channel)?;
        let c = ch.clone();
        blocking(&ch.path, move || c.end()).await
    }
}
