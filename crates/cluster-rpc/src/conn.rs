//! Length-delimited framing: each frame is a 4-byte big-endian length followed by that many
//! bytes of postcard ([`crate::codec`]).
//!
//! A length above the configured limit, a stream that ends inside a frame, a frame that does
//! not arrive whole within the frame timeout and a frame that does not decode are all fatal
//! *for that connection only*: the reader reports a [`FrameError`], the connection is closed and
//! logged, and every other connection carries on.
//!
//! Integrity: on a connection whose handshake used a secret, frames travel in *records*, the
//! frames of one write: a lone frame, or a writer's batch. A record's last frame has the top bit
//! of its length field set ([`RECORD_END`]) and is followed by a [`TAG_LEN`]-byte MAC
//! ([`FrameMac`]): HMAC-SHA256 under the direction's session key, over the record's sequence
//! number in that direction and its bytes (lengths included), truncated. The reader hands out
//! no frame of a record before its tag has checked out. A frame altered, replayed, reordered or
//! dropped in transit fails the check, which closes the connection (and is logged). One tag per
//! write rather than per frame keeps the cost of the MACs small under load, when a write
//! carries many frames. Without a secret frames carry no MAC and no flag.
//!
//! A frame's announced length is never allocated up front: the reader's buffer grows by at most
//! [`READ_BUFFER_BYTES`] beyond the bytes that have arrived, so a peer that announces a large
//! frame and stalls costs one buffer, not the announced size.

use std::io;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::codec;
use crate::frame::Frame;

/// The most frames a writer sends in one system call (see [`write_queued`]).
pub(crate) const BATCH_FRAMES_MAX: usize = 64;

/// The most bytes a writer gathers for one system call; a frame larger than this goes alone.
pub(crate) const BATCH_BYTES_MAX: usize = 256 * 1024;

/// The bytes a connection's reader takes from its socket at most in one system call.
pub(crate) const READ_BUFFER_BYTES: usize = 64 * 1024;

/// The bytes of a record's MAC: HMAC-SHA256 truncated to 128 bits.
pub(crate) const TAG_LEN: usize = 16;

/// Set in the length field of a record's last frame, on a connection with MACs: the record's
/// tag follows that frame. (Frame lengths are at most 1 GiB, so the bit is free.)
const RECORD_END: u32 = 1 << 31;

/// The MAC of one direction of a connection: a key from the handshake and the sequence number
/// of the next record (each side counts the records it sends and those it receives, so no
/// number travels).
#[derive(Clone)]
pub(crate) struct FrameMac {
    /// HMAC keyed once; each frame starts from a copy.
    keyed: Hmac<Sha256>,
    sequence: u64,
}

impl FrameMac {
    /// The MAC of a direction whose session key is `key`, from sequence number 0.
    pub(crate) fn new(key: &[u8]) -> FrameMac {
        // HMAC accepts keys of any length.
        let keyed = <Hmac<Sha256> as Mac>::new_from_slice(key)
            .unwrap_or_else(|_| <Hmac<Sha256> as Mac>::new(&Default::default()));
        FrameMac { keyed, sequence: 0 }
    }

    fn next(&mut self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(&self.sequence.to_be_bytes());
        for part in parts {
            mac.update(part);
        }
        self.sequence = self.sequence.wrapping_add(1);
        mac
    }

    /// The tag of the next record sent, the concatenation of `parts`.
    pub(crate) fn seal(&mut self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut tag = [0_u8; TAG_LEN];
        tag.copy_from_slice(&self.next(parts).finalize().into_bytes()[..TAG_LEN]);
        tag
    }

    /// Whether `tag` is the tag of the next record received, `record` (compared in constant
    /// time).
    pub(crate) fn open(&mut self, record: &[u8], tag: &[u8]) -> bool {
        self.next(&[record]).verify_truncated_left(tag).is_ok()
    }
}

/// Why a connection's frame stream broke.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The socket failed or was closed inside a frame.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// A frame announced more bytes than the limit.
    #[error("a frame of {len} bytes exceeds the limit of {max} bytes")]
    Oversize {
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A frame did not decode.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A frame failed its MAC check: altered, replayed, reordered or dropped in transit, or
    /// sent by a peer without the session key.
    #[error("a frame failed its integrity check (altered, replayed or reordered in transit)")]
    BadMac,
    /// A frame started but did not arrive whole within the frame timeout.
    #[error("a frame did not arrive whole within {0:?} of its start (CLUSTER_RPC_FRAME_TIMEOUT)")]
    Timeout(Duration),
}

/// A connection's incoming frames: the socket is read in bulk into one buffer, and each frame's
/// body is handed out as a slice of it, so a frame costs neither a system call nor an
/// allocation of its own.
///
/// The buffer holds [`READ_BUFFER_BYTES`]; a frame larger than that (up to the frame limit)
/// grows it as its bytes arrive, by at most [`READ_BUFFER_BYTES`] beyond them, for as long as it
/// is read, and it shrinks back once that frame is taken. A frame must arrive whole within the
/// frame timeout of the first read that found it incomplete.
pub(crate) struct FrameReader<R> {
    reader: R,
    buffer: Vec<u8>,
    /// Where the bytes not yet handed out start.
    start: usize,
    /// Where the bytes read so far end.
    end: usize,
    max_frame_bytes: u32,
    frame_timeout: Duration,
    /// When the frame under way must have arrived whole.
    deadline: Option<Instant>,
    /// The MAC of the incoming direction, when the connection has one.
    mac: Option<FrameMac>,
    /// With a MAC: the bytes from `start` that belong to frames of a record whose tag checked
    /// out, not yet handed out (the tag follows them).
    verified: usize,
    /// With a MAC: the bytes from `start` of the record under way already scanned (whole
    /// frames without the record flag).
    scanned: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader of `reader`'s frames, refusing frames above `max_frame_bytes`, frames that do
    /// not arrive whole within `frame_timeout` and, with `mac`, frames that fail their MAC.
    pub(crate) fn new(
        reader: R,
        max_frame_bytes: u32,
        frame_timeout: Duration,
        mac: Option<FrameMac>,
    ) -> FrameReader<R> {
        FrameReader {
            reader,
            buffer: vec![0; READ_BUFFER_BYTES],
            start: 0,
            end: 0,
            max_frame_bytes,
            frame_timeout,
            deadline: None,
            mac,
            verified: 0,
            scanned: 0,
        }
    }

    /// The next frame's body, or `None` when the peer closed the connection between frames.
    ///
    /// Cancel safe: the buffer keeps what was read, and a cancelled read loses nothing.
    pub(crate) async fn next_frame(&mut self) -> Result<Option<&[u8]>, FrameError> {
        let body = loop {
            // The bytes from `start` needed before anything more can be handed out.
            let needed = if self.verified > 0 {
                // A frame of a record whose tag checked out: whole in the buffer.
                let header =
                    self.buffer[self.start..].first_chunk::<4>().copied().unwrap_or_default();
                let frame = 4 + usize::try_from(u32::from_be_bytes(header) & !RECORD_END)
                    .unwrap_or(usize::MAX);
                let body = self.start + 4..self.start + frame;
                self.start += frame;
                self.verified = self.verified.saturating_sub(frame);
                if self.verified == 0 {
                    // The record's tag.
                    self.start += TAG_LEN;
                }
                break body;
            } else if self.mac.is_some() {
                match self.check_record()? {
                    None => continue,
                    Some(needed) => needed,
                }
            } else {
                let arrived = &self.buffer[self.start..self.end];
                // The frame's full size (its length, then its body), once its length has arrived.
                match arrived.first_chunk::<4>() {
                    None => 4,
                    Some(header) => {
                        let needed = 4 + self.frame_len(u32::from_be_bytes(*header))?;
                        if arrived.len() >= needed {
                            let body = self.start + 4..self.start + needed;
                            self.start += needed;
                            self.deadline = None;
                            break body;
                        }
                        needed
                    }
                }
            };
            // Between frames a connection may idle; inside one it has `frame_timeout`.
            let deadline = match self.start == self.end {
                true => None,
                false => {
                    Some(*self.deadline.get_or_insert_with(|| Instant::now() + self.frame_timeout))
                }
            };
            self.make_room(needed);
            let read = self.reader.read(&mut self.buffer[self.end..]);
            let read = match deadline {
                None => read.await?,
                Some(deadline) => match tokio::time::timeout_at(deadline, read).await {
                    Ok(read) => read?,
                    Err(_) => return Err(FrameError::Timeout(self.frame_timeout)),
                },
            };
            if read == 0 {
                if self.start == self.end {
                    return Ok(None);
                }
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
            self.end += read;
        };
        Ok(Some(&self.buffer[body]))
    }

    /// The body length a frame's length field announces (without the record flag), checked
    /// against the limit.
    fn frame_len(&self, field: u32) -> Result<usize, FrameError> {
        let len = match self.mac {
            Some(_) => field & !RECORD_END,
            None => field,
        };
        if len > self.max_frame_bytes {
            return Err(FrameError::Oversize { len, max: self.max_frame_bytes });
        }
        usize::try_from(len).map_err(|_| FrameError::Oversize { len, max: self.max_frame_bytes })
    }

    /// Checks the record under way, from `start`, once it has arrived whole: `None` when its tag
    /// checked out (its frames can be handed out), or the bytes from `start` needed to go on.
    /// Its frames are scanned once each, as they arrive.
    fn check_record(&mut self) -> Result<Option<usize>, FrameError> {
        let most = usize::try_from(self.max_frame_bytes)
            .unwrap_or(usize::MAX)
            .saturating_add(4 + TAG_LEN + BATCH_BYTES_MAX);
        loop {
            let at = self.start + self.scanned;
            let Some(header) = self.buffer[at..self.end].first_chunk::<4>() else {
                return Ok(Some(self.scanned + 4));
            };
            let field = u32::from_be_bytes(*header);
            let frame = 4 + self.frame_len(field)?;
            let last = field & RECORD_END != 0;
            let record = self.scanned + frame + if last { TAG_LEN } else { 0 };
            if record > most {
                return Err(FrameError::Malformed(format!(
                    "a record of more than {most} bytes (frames without a tag)"
                )));
            }
            if self.end - self.start < record {
                return Ok(Some(record));
            }
            if !last {
                self.scanned = record;
                continue;
            }
            let bytes = self.start..self.start + record - TAG_LEN;
            let tag = bytes.end..bytes.end + TAG_LEN;
            let Some(mac) = &mut self.mac else { return Ok(None) };
            if !mac.open(&self.buffer[bytes], &self.buffer[tag]) {
                return Err(FrameError::BadMac);
            }
            self.verified = record - TAG_LEN;
            self.scanned = 0;
            self.deadline = None;
            return Ok(None);
        }
    }

    /// The next frame, decoded, or `None` when the connection ended: the peer closed it
    /// (logged at debug) or sent something that is not a frame (logged as a warning). Both
    /// sides' readers take their frames here.
    pub(crate) async fn next_decoded(&mut self) -> Option<Frame<'_>> {
        match self.next_frame().await {
            Ok(Some(body)) => match codec::decode(body) {
                Ok(frame) => Some(frame),
                Err(error) => {
                    let error = FrameError::Malformed(error.to_string());
                    warn!(%error, "bad frame; closing the connection");
                    None
                }
            },
            Ok(None) => {
                debug!("peer closed the connection");
                None
            }
            Err(error) => {
                warn!(%error, "bad frame; closing the connection");
                None
            }
        }
    }

    /// Makes room behind the bytes read for a frame of `needed` bytes that starts at `start`:
    /// the partial frame moves to the front, and the buffer grows for a frame larger than it,
    /// by at most [`READ_BUFFER_BYTES`] beyond the bytes that have arrived (never to the
    /// announced length up front).
    fn make_room(&mut self, needed: usize) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buffer.len() > READ_BUFFER_BYTES && needed <= READ_BUFFER_BYTES {
                // A large frame's room is given back once it is taken.
                self.buffer.truncate(READ_BUFFER_BYTES);
                self.buffer.shrink_to_fit();
            }
        }
        if self.buffer.len() - self.start < needed {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let arrived = self.end - self.start;
        let wanted = self.start + needed.min(arrived + READ_BUFFER_BYTES);
        if self.buffer.len() < wanted {
            // `Vec` doubles its capacity as it grows: a large frame is copied a few times, and
            // its buffer is at most twice the bytes that have arrived.
            self.buffer.resize(wanted, 0);
        }
    }
}

/// Writes one frame whose body is `body` (already checked against the limit by the encoder),
/// sealed with `mac` when the connection has one: the length, the body and the tag go out in
/// one vectored write where the stream allows it, so a frame is one system call and, with
/// `TCP_NODELAY`, one segment rather than two.
///
/// Not cancel safe: only the connection's writer task calls it.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    body: &[u8],
    mac: Option<&mut FrameMac>,
) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame longer than 4 GiB"))?;
    let (header, tag) = match mac {
        None => (len.to_be_bytes(), None),
        Some(mac) => {
            let header = (len | RECORD_END).to_be_bytes();
            (header, Some(mac.seal(&[&header, body])))
        }
    };
    let mut parts: [&[u8]; 3] = [&header, body, tag.as_ref().map_or(&[], |tag| tag.as_slice())];
    let mut first = 0;
    while first < parts.len() {
        if parts[first].is_empty() {
            first += 1;
            continue;
        }
        let slices = parts.map(io::IoSlice::new);
        let mut n = writer.write_vectored(&slices[first..]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && first < parts.len() {
            let taken = n.min(parts[first].len());
            parts[first] = &parts[first][taken..];
            n -= taken;
            if parts[first].is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}

/// Writes `first` and the frames queued behind it in `out`, together.
///
/// - **Alone.** With nothing queued behind it, `first` goes as [`write_frame`] sends it.
/// - **Batched.** Otherwise the queued frames are gathered, up to [`BATCH_FRAMES_MAX`] frames
///   and [`BATCH_BYTES_MAX`] bytes, into `buffer`, and go out in one write: under load a peer's
///   frames cost one system call (and, with `TCP_NODELAY`, few segments) instead of one each.
/// - **Order.** Frames go out in the order they were queued.
///
/// `buffer` is the writer's, kept between calls so that its room is reused.
/// Not cancel safe: only a connection's writer task calls it.
pub(crate) async fn write_queued<W: AsyncWrite + Unpin>(
    writer: &mut W,
    first: Vec<u8>,
    out: &mut mpsc::Receiver<Vec<u8>>,
    buffer: &mut Vec<u8>,
    mac: &mut Option<FrameMac>,
) -> io::Result<()> {
    let mut next = match out.try_recv() {
        Ok(body) => body,
        Err(_) => {
            // The tasks that are ready to run may queue more frames: they run first, once.
            tokio::task::yield_now().await;
            match out.try_recv() {
                Ok(body) => body,
                Err(_) => return write_frame(writer, &first, mac.as_mut()).await,
            }
        }
    };
    buffer.clear();
    // Where the last frame pushed starts: the frame that ends the record, with a MAC.
    let mut last = 0;
    push_frame(buffer, &first)?;
    let mut frames = 1;
    loop {
        if frames == BATCH_FRAMES_MAX || buffer.len() + 4 + next.len() + TAG_LEN > BATCH_BYTES_MAX {
            // Full: this batch goes, and `next` starts the following one.
            seal_record(buffer, last, mac.as_mut());
            writer.write_all(buffer).await?;
            buffer.clear();
            frames = 0;
        }
        last = buffer.len();
        push_frame(buffer, &next)?;
        frames += 1;
        match out.try_recv() {
            Ok(body) => next = body,
            Err(_) => break,
        }
    }
    seal_record(buffer, last, mac.as_mut());
    let sent = writer.write_all(buffer).await;
    // A burst's room is given back once it is sent.
    buffer.clear();
    buffer.shrink_to(BATCH_BYTES_MAX);
    sent
}

/// Appends one frame (its length, then `body`) to `buffer`.
fn push_frame(buffer: &mut Vec<u8>, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame longer than 4 GiB"))?;
    buffer.extend_from_slice(&len.to_be_bytes());
    buffer.extend_from_slice(body);
    Ok(())
}

/// With `mac`, makes the frames in `buffer` one record: flags the last frame, which starts at
/// `last`, and appends the record's tag.
fn seal_record(buffer: &mut Vec<u8>, last: usize, mac: Option<&mut FrameMac>) {
    let Some(mac) = mac else { return };
    if let Some(flag) = buffer.get_mut(last) {
        *flag |= 0x80;
    }
    let tag = mac.seal(&[buffer]);
    buffer.extend_from_slice(&tag);
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::{self, IoSlice};
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use std::time::Duration;

    use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

    use super::{FrameError, FrameReader, READ_BUFFER_BYTES};

    /// A frame timeout no test reaches.
    const LONG: Duration = Duration::from_secs(60);

    /// A socket whose bytes arrive at most `step` at a time; counts the reads that take some,
    /// and notes the most room a read offered.
    pub(crate) struct Chunked {
        bytes: Vec<u8>,
        at: usize,
        step: usize,
        pub(crate) reads: usize,
        pub(crate) most_room: usize,
    }

    impl Chunked {
        /// A socket that has received `bytes`, handing out at most `step` per read.
        pub(crate) fn new(bytes: Vec<u8>, step: usize) -> Chunked {
            Chunked { bytes, at: 0, step, reads: 0, most_room: 0 }
        }
    }

    impl AsyncRead for Chunked {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            self.most_room = self.most_room.max(buf.remaining());
            let n = buf.remaining().min(self.step).min(self.bytes.len() - self.at);
            if n > 0 {
                let at = self.at;
                buf.put_slice(&self.bytes[at..at + n]);
                self.at += n;
                self.reads += 1;
            }
            Poll::Ready(Ok(()))
        }
    }

    fn framed(bodies: &[&[u8]]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for body in bodies {
            bytes.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
            bytes.extend_from_slice(body);
        }
        bytes
    }

    /// Every frame's body, in order, however the bytes arrive; then the clean end.
    #[tokio::test]
    async fn frames_are_read_whole_however_the_bytes_arrive() {
        let large = vec![7_u8; 3 * READ_BUFFER_BYTES + 5];
        let bodies: [&[u8]; 5] = [b"one", b"", &large, b"four", b"five"];
        for step in [1, 2, 3, 5, 4096, usize::MAX] {
            let socket = Chunked::new(framed(&bodies), step);
            let mut reader = FrameReader::new(socket, 1 << 24, LONG, None);
            for body in bodies {
                let read = reader.next_frame().await.unwrap().unwrap();
                assert_eq!(read, body, "step {step}");
            }
            assert!(reader.next_frame().await.unwrap().is_none(), "step {step}");
            assert_eq!(
                reader.buffer.len(),
                READ_BUFFER_BYTES,
                "the large frame's room is given back"
            );
        }
    }

    #[tokio::test]
    async fn a_stream_that_ends_inside_a_frame_is_an_error() {
        for cut in [1, 3, 4, 6] {
            let mut bytes = framed(&[b"whole", b"cut short"]);
            bytes.truncate(9 + cut);
            let mut reader = FrameReader::new(Chunked::new(bytes, 2), 1 << 20, LONG, None);
            assert_eq!(reader.next_frame().await.unwrap().unwrap(), b"whole");
            let error = reader.next_frame().await.unwrap_err();
            assert!(
                matches!(&error, FrameError::Io(error) if error.kind() == io::ErrorKind::UnexpectedEof),
                "cut at {cut}: {error}"
            );
        }
    }

    /// A frame above the limit is refused from its length, before its body is read.
    #[tokio::test]
    async fn an_oversize_frame_is_refused_from_its_length() {
        let bytes = framed(&[&[0_u8; 100]]);
        let mut reader = FrameReader::new(Chunked::new(bytes, 4), 99, LONG, None);
        let error = reader.next_frame().await.unwrap_err();
        assert!(matches!(error, FrameError::Oversize { len: 100, max: 99 }), "{error}");
        assert_eq!(reader.reader.at, 4, "only the length was read");
    }

    /// A large frame is read into a buffer that grows as its bytes arrive, never to its
    /// announced length at once: no read is offered more than [`READ_BUFFER_BYTES`] of room.
    #[tokio::test]
    async fn a_large_frame_grows_the_buffer_as_it_arrives() {
        let large = vec![7_u8; 16 * READ_BUFFER_BYTES];
        let mut reader =
            FrameReader::new(Chunked::new(framed(&[&large]), 1000), 1 << 24, LONG, None);
        assert_eq!(reader.next_frame().await.unwrap().unwrap(), large);
        assert!(
            reader.reader.most_room <= READ_BUFFER_BYTES,
            "a read was offered {} bytes of room",
            reader.reader.most_room
        );
    }

    /// A peer that announces a near-maximal frame and sends one byte of it costs one buffer,
    /// not the announced length, and the reader gives up after the frame timeout.
    #[tokio::test]
    async fn a_stalled_frame_costs_one_buffer_and_times_out() {
        let (mut peer, socket) = tokio::io::duplex(1 << 16);
        let max = 8 << 20;
        peer.write_all(&(max - 1_u32).to_be_bytes()).await.unwrap();
        peer.write_all(&[1]).await.unwrap();
        let timeout = Duration::from_millis(200);
        let mut reader = FrameReader::new(socket, max, timeout, None);
        let started = tokio::time::Instant::now();
        let next = tokio::time::timeout(Duration::from_secs(10), reader.next_frame()).await;
        let error = next.expect("the reader gives up on the frame").unwrap_err();
        assert!(matches!(error, FrameError::Timeout(after) if after == timeout), "{error}");
        assert!(started.elapsed() >= timeout);
        assert!(
            reader.buffer.capacity() <= 2 * READ_BUFFER_BYTES,
            "{} bytes allocated for a frame of which 1 byte arrived",
            reader.buffer.capacity()
        );
        drop(peer);
    }

    /// Between frames a connection may idle as long as it likes: only a started frame has a
    /// deadline.
    #[tokio::test]
    async fn an_idle_connection_between_frames_does_not_time_out() {
        let (mut peer, socket) = tokio::io::duplex(1 << 16);
        let mut reader = FrameReader::new(socket, 1 << 20, Duration::from_millis(50), None);
        let idle = tokio::time::timeout(Duration::from_millis(300), reader.next_frame()).await;
        assert!(idle.is_err(), "the reader gave up on an idle connection: {idle:?}");
        peer.write_all(&framed(&[b"late"])).await.unwrap();
        assert_eq!(reader.next_frame().await.unwrap().unwrap(), b"late");
    }

    /// A stream that takes at most `step` bytes per write, vectored or not, and counts writes.
    struct Trickle {
        bytes: Vec<u8>,
        step: usize,
        writes: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.step);
            self.bytes.extend_from_slice(&buf[..n]);
            self.writes += 1;
            Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let mut left = self.step;
            for buf in bufs {
                let n = buf.len().min(left);
                self.bytes.extend_from_slice(&buf[..n]);
                left -= n;
            }
            self.writes += 1;
            Poll::Ready(Ok(self.step - left))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    async fn written(step: usize, body: &[u8]) -> Trickle {
        let mut stream = Trickle { bytes: Vec::new(), step, writes: 0 };
        super::write_frame(&mut stream, body, None).await.unwrap();
        stream
    }

    #[tokio::test]
    async fn a_frame_is_one_write_when_the_stream_takes_it_all() {
        let stream = written(usize::MAX, b"hello").await;
        assert_eq!(stream.bytes, b"\0\0\0\x05hello");
        assert_eq!(stream.writes, 1, "the length and the body go out together");
    }

    /// The frames queued in `out` behind `first`, written as a writer task writes them.
    async fn queued(step: usize, first: &[u8], behind: &[&[u8]]) -> Trickle {
        let (sender, mut out) = tokio::sync::mpsc::channel(256);
        for body in behind {
            sender.try_send(body.to_vec()).unwrap();
        }
        let mut stream = Trickle { bytes: Vec::new(), step, writes: 0 };
        let mut buffer = Vec::new();
        super::write_queued(&mut stream, first.to_vec(), &mut out, &mut buffer, &mut None)
            .await
            .unwrap();
        stream
    }

    #[tokio::test]
    async fn queued_frames_go_out_in_one_write_in_their_order() {
        let stream = queued(usize::MAX, b"one", &[b"two", b"three"]).await;
        assert_eq!(stream.bytes, b"\0\0\0\x03one\0\0\0\x03two\0\0\0\x05three");
        assert_eq!(stream.writes, 1, "three frames, one write");
        let alone = queued(usize::MAX, b"one", &[]).await;
        assert_eq!(alone.bytes, b"\0\0\0\x03one");
        assert_eq!(alone.writes, 1);
    }

    #[tokio::test]
    async fn a_batch_stops_at_its_frame_and_byte_limits() {
        let small = [b"x".as_slice(); 2 * super::BATCH_FRAMES_MAX];
        let stream = queued(usize::MAX, b"x", &small).await;
        assert_eq!(stream.bytes.len(), (2 * super::BATCH_FRAMES_MAX + 1) * 5);
        assert_eq!(stream.writes, 3, "64 frames, 64 frames, then the last one");
        let large = vec![7_u8; super::BATCH_BYTES_MAX / 2];
        let stream = queued(usize::MAX, &large, &[&large, &large]).await;
        assert_eq!(stream.bytes.len(), 3 * (large.len() + 4));
        assert_eq!(stream.writes, 3, "two halves and their headers do not fit in one batch");
    }

    /// A frame queued by a task that was ready to run when the writer woke goes out in the
    /// same write as the frame that woke it.
    #[tokio::test]
    async fn a_frame_queued_by_a_ready_task_joins_the_write() {
        let (sender, mut out) = tokio::sync::mpsc::channel(8);
        let queued = tokio::spawn(async move { sender.send(b"two".to_vec()).await.unwrap() });
        let mut stream = Trickle { bytes: Vec::new(), step: usize::MAX, writes: 0 };
        let mut buffer = Vec::new();
        super::write_queued(&mut stream, b"one".to_vec(), &mut out, &mut buffer, &mut None)
            .await
            .unwrap();
        queued.await.unwrap();
        assert_eq!(stream.bytes, b"\0\0\0\x03one\0\0\0\x03two");
        assert_eq!(stream.writes, 1, "two frames, one write");
    }

    const KEY: &[u8] = b"a session key of thirty-two bytes";

    /// `bodies` as a writer task sends them, sealed with [`KEY`], `step` bytes per write at most.
    async fn sealed(step: usize, bodies: &[&[u8]]) -> Vec<u8> {
        let (sender, mut out) = tokio::sync::mpsc::channel(64);
        for body in &bodies[1..] {
            sender.try_send(body.to_vec()).unwrap();
        }
        let mut stream = Trickle { bytes: Vec::new(), step, writes: 0 };
        let mut mac = Some(super::FrameMac::new(KEY));
        let first = bodies[0].to_vec();
        super::write_queued(&mut stream, first, &mut out, &mut Vec::new(), &mut mac).await.unwrap();
        stream.bytes
    }

    /// Every frame of `bytes`, read with `key`, or the first error.
    async fn opened(bytes: Vec<u8>, key: &[u8]) -> Result<Vec<Vec<u8>>, FrameError> {
        let mac = Some(super::FrameMac::new(key));
        let mut reader = FrameReader::new(Chunked::new(bytes, 7), 1 << 20, LONG, mac);
        let mut frames = Vec::new();
        while let Some(body) = reader.next_frame().await? {
            frames.push(body.to_vec());
        }
        Ok(frames)
    }

    /// Sealed frames read back whole, alone or batched, however the writes were cut; a byte
    /// altered anywhere (length, body or tag) is refused.
    #[tokio::test]
    async fn sealed_frames_read_back_and_any_altered_byte_is_refused() {
        let bodies: [&[u8]; 3] = [b"one", b"", b"three"];
        for step in [1, 3, usize::MAX] {
            let alone = sealed(step, &bodies[..1]).await;
            assert_eq!(alone.len(), 4 + 3 + super::TAG_LEN, "step {step}");
            assert_eq!(opened(alone, KEY).await.unwrap(), [b"one"], "step {step}");
            let batch = sealed(step, &bodies).await;
            assert_eq!(opened(batch, KEY).await.unwrap(), bodies, "step {step}");
        }
        let batch = sealed(usize::MAX, &bodies).await;
        for at in 0..batch.len() {
            let mut altered = batch.clone();
            altered[at] ^= 0x01;
            assert!(opened(altered, KEY).await.is_err(), "byte {at} altered unnoticed");
        }
        let error = opened(batch, b"the other direction's key").await.unwrap_err();
        assert!(matches!(error, FrameError::BadMac), "{error}");
    }

    /// A record replayed, or records swapped or dropped, fail their check: the sequence number
    /// is covered.
    #[tokio::test]
    async fn a_replayed_or_reordered_record_is_refused() {
        let mut stream = Trickle { bytes: Vec::new(), step: usize::MAX, writes: 0 };
        let mut mac = super::FrameMac::new(KEY);
        super::write_frame(&mut stream, b"first", Some(&mut mac)).await.unwrap();
        super::write_frame(&mut stream, b"second", Some(&mut mac)).await.unwrap();
        assert_eq!(opened(stream.bytes.clone(), KEY).await.unwrap(), [&b"first"[..], b"second"]);
        let (first, second) = stream.bytes.split_at(4 + 5 + super::TAG_LEN);
        let replayed = [first, second, second].concat();
        let error = opened(replayed, KEY).await.unwrap_err();
        assert!(matches!(error, FrameError::BadMac), "{error}");
        let reordered = [second, first].concat();
        let error = opened(reordered, KEY).await.unwrap_err();
        assert!(matches!(error, FrameError::BadMac), "{error}");
        let dropped = second.to_vec();
        assert!(matches!(opened(dropped, KEY).await, Err(FrameError::BadMac)));
    }

    /// A batch is one record with one tag, and none of its frames is handed out before the tag
    /// has checked out.
    #[tokio::test]
    async fn a_batch_is_one_record_checked_before_any_of_its_frames_is_handed_out() {
        let bodies: [&[u8]; 3] = [b"one", b"two", b"three"];
        let batch = sealed(usize::MAX, &bodies).await;
        assert_eq!(batch.len(), 3 * 4 + 3 + 3 + 5 + super::TAG_LEN, "one tag for the batch");
        let mut forged = batch.clone();
        let last = forged.len() - 1;
        forged[last] ^= 0x01;
        let mac = Some(super::FrameMac::new(KEY));
        let mut reader = FrameReader::new(Chunked::new(forged, usize::MAX), 1 << 20, LONG, mac);
        let first = reader.next_frame().await.map(|frame| frame.map(<[u8]>::to_vec));
        assert!(matches!(first, Err(FrameError::BadMac)), "{first:?}");
        // Frames without a tag are not gathered without end.
        let mut untagged = Vec::new();
        for _ in 0..64 {
            untagged.extend_from_slice(&framed(&[&[0_u8; 8192]]));
        }
        let mac = Some(super::FrameMac::new(KEY));
        let mut reader = FrameReader::new(Chunked::new(untagged, usize::MAX), 8192, LONG, mac);
        let error = reader.next_frame().await.unwrap_err();
        assert!(matches!(error, FrameError::Malformed(_)), "{error}");
    }

    #[tokio::test]
    async fn a_batch_survives_partial_writes() {
        let stream = queued(3, b"one", &[b"two"]).await;
        assert_eq!(stream.bytes, b"\0\0\0\x03one\0\0\0\x03two");
    }

    #[tokio::test]
    async fn partial_writes_still_send_the_whole_frame_in_order() {
        for step in [1, 2, 3, 4, 5, 7] {
            let stream = written(step, b"hello world").await;
            assert_eq!(stream.bytes, b"\0\0\0\x0bhello world", "step {step}");
        }
        let empty = written(2, b"").await;
        assert_eq!(empty.bytes, b"\0\0\0\0");
    }
}
