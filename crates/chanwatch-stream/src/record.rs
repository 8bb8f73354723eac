//! The record format of a channel file, and the scan that finds its records.
//!
//! Owns: the bytes of one record — `len: u32 LE`, `crc: u32 LE`, `payload` (`len` bytes),
//! where `crc` is CRC-32 (IEEE) over the four length bytes and the payload, so a zero-filled
//! tail (which some filesystems leave after a crash) never passes as an empty record — and
//! telling a torn tail (cut off, safe to truncate) from damage before the end (fatal).
//! Must not: open, lock or truncate files; the caller ([`crate::file`]) decides.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::MAX_MESSAGE_BYTES;

/// Bytes before the payload.
pub(crate) const HEADER: usize = 8;

/// How much the scan reads at once.
const CHUNK: usize = 1 << 20;

/// One record's bytes, ready for a single `write`.
pub(crate) fn encode(payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_le_bytes();
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len);
    hasher.update(payload);
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&len);
    out.extend_from_slice(&hasher.finalize().to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of a record whose bytes are `record` (header included), if its checksum holds.
pub(crate) fn decode(record: &[u8]) -> Option<&[u8]> {
    let (header, payload) = record.split_at_checked(HEADER)?;
    let len = u32::from_le_bytes(header[..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().ok()?);
    if payload.len() != len {
        return None;
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&header[..4]);
    hasher.update(payload);
    (hasher.finalize() == crc).then_some(payload)
}

/// What a scan found after the last good record.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Tail {
    /// The file ends right after the last good record.
    Clean,
    /// A cut-off or damaged last record (or zeros) from `end` to the end of the file: a write
    /// in progress, or one a crash interrupted. Readers stop before it; a writer truncates it.
    Torn,
    /// A damaged record at `end` with a good record or other data after it.
    Corrupt(String),
}

/// The records found from some offset to the length the scan was given.
#[derive(Debug)]
pub(crate) struct Scan {
    /// Start offset of each good record, in order.
    pub starts: Vec<u64>,
    /// Where the last good record ends (the scan's start when none).
    pub end: u64,
    /// What lies in `end..len`.
    pub tail: Tail,
}

/// Finds the records of `file` in `from..len` (`from` is a record boundary).
pub(crate) fn scan(file: &File, from: u64, len: u64) -> std::io::Result<Scan> {
    let mut starts = Vec::new();
    let mut at = from;
    let mut buf = Vec::new();
    let mut buf_at = from; // file offset of buf[0]
    loop {
        if at >= len {
            return Ok(Scan {
                starts,
                end: at,
                tail: Tail::Clean,
            });
        }
        let left = len - at;
        let header_in_buf = at + HEADER as u64 <= buf_at + buf.len() as u64;
        if left < HEADER as u64 {
            return Ok(Scan {
                starts,
                end: at,
                tail: Tail::Torn,
            });
        }
        if !header_in_buf {
            buf = read_at(file, at, CHUNK.min(left as usize))?;
            buf_at = at;
        }
        let rel = (at - buf_at) as usize;
        let declared = u32::from_le_bytes([buf[rel], buf[rel + 1], buf[rel + 2], buf[rel + 3]]);
        let record_len = HEADER as u64 + u64::from(declared);
        if record_len > left {
            // The record would end past the file: cut off by a crash or still being written.
            return Ok(Scan {
                starts,
                end: at,
                tail: Tail::Torn,
            });
        }
        if declared as usize > MAX_MESSAGE_BYTES {
            return damaged(file, starts, at, len, "a length over the limit");
        }
        if at + record_len > buf_at + buf.len() as u64 {
            buf = read_at(file, at, CHUNK.max(record_len as usize).min(left as usize))?;
            buf_at = at;
        }
        let rel = (at - buf_at) as usize;
        if decode(&buf[rel..rel + record_len as usize]).is_none() {
            return damaged(file, starts, at, len, "a checksum mismatch");
        }
        starts.push(at);
        at += record_len;
    }
}

/// A bad record at `at`: a torn tail when it is the last thing in the file or only zeros
/// follow, damage otherwise.
fn damaged(file: &File, starts: Vec<u64>, at: u64, len: u64, what: &str) -> std::io::Result<Scan> {
    let declared = read_at(file, at, 4)?;
    let declared = u32::from_le_bytes([declared[0], declared[1], declared[2], declared[3]]);
    let record_end = at + HEADER as u64 + u64::from(declared);
    let mut torn = record_end >= len;
    if !torn {
        // Zeros after it too: a zero-filled tail, not a record followed by others.
        let rest = read_at(
            file,
            record_end,
            (len - record_end).min(CHUNK as u64) as usize,
        )?;
        torn = len - record_end <= CHUNK as u64 && rest.iter().all(|b| *b == 0);
    }
    Ok(Scan {
        starts,
        end: at,
        tail: if torn {
            Tail::Torn
        } else {
            Tail::Corrupt(format!("{what} in a record followed by more data"))
        },
    })
}

/// Reads exactly `n` bytes at `offset`.
pub(crate) fn read_at(file: &File, offset: u64, n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0; n];
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().expect("temp file");
        f.write_all(bytes).expect("write");
        f
    }

    fn scan_all(bytes: &[u8]) -> Scan {
        let f = file_with(bytes);
        scan(&f, 0, bytes.len() as u64).expect("scan")
    }

    #[test]
    fn records_round_trip_and_a_flipped_bit_fails_the_checksum() {
        let rec = encode(b"hello");
        assert_eq!(decode(&rec), Some(&b"hello"[..]));
        let mut bad = rec.clone();
        bad[HEADER + 1] ^= 1;
        assert_eq!(decode(&bad), None);
        // An all-zero header is no empty record.
        assert_eq!(decode(&[0; HEADER]), None);
    }

    #[test]
    fn a_scan_finds_every_record_and_names_the_tail() {
        let mut bytes = [encode(b"a"), encode(b""), encode(&[7; 3000])].concat();
        let s = scan_all(&bytes);
        assert_eq!(s.starts, vec![0, 9, 17]);
        assert_eq!((s.end, s.tail), (bytes.len() as u64, Tail::Clean));

        // A record cut in the middle of its payload: torn.
        let whole = bytes.len() as u64;
        bytes.extend_from_slice(&encode(b"last")[..10]);
        let s = scan_all(&bytes);
        assert_eq!((s.starts.len(), s.end, s.tail), (3, whole, Tail::Torn));

        // Zeros after the good records: torn, not corrupt.
        bytes.truncate(whole as usize);
        bytes.extend_from_slice(&[0; 100]);
        let s = scan_all(&bytes);
        assert_eq!((s.starts.len(), s.end, s.tail), (3, whole, Tail::Torn));
    }

    #[test]
    fn damage_before_a_good_record_is_corrupt() {
        let mut bytes = [encode(b"one"), encode(b"two"), encode(b"three")].concat();
        bytes[HEADER + 11 + 1] ^= 0xff; // the payload of "two"
        let s = scan_all(&bytes);
        assert_eq!((s.starts.len(), s.end), (1, 11));
        assert!(matches!(s.tail, Tail::Corrupt(_)), "{:?}", s.tail);
    }
}
