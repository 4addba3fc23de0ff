//! Entry points for the coverage-guided fuzz targets in `fuzz/` (feature `fuzzing`): the
//! transport's frame reader, frame decoder and handshakes, fed with arbitrary bytes.
//!
//! Each function must return for every input without panicking; none is part of the API.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::codec::{self, Names};
use crate::conn::{FrameMac, FrameReader};
use crate::frame::Frame;
use crate::handshake;

/// The frame limit of the fuzzed reader: small, so that the limit is reached.
const MAX_FRAME_BYTES: u32 = 64 * 1024;

/// Reads frames from `input` as a connection's reader does, and decodes each into the domain
/// types as the server and the client do.
///
/// The first byte chooses whether the reader checks MACs (odd) and how many bytes each read
/// returns (1 to 128); the rest is the byte stream.
pub fn read_frames(input: &[u8]) {
    let Some((&mode, stream)) = input.split_first() else { return };
    let mac = (mode & 1 == 1).then(|| FrameMac::new(b"a fuzzing key"));
    let step = usize::from(mode >> 1).max(1);
    let reader = Scripted { script: stream, step };
    block_on(async move {
        let mut frames = FrameReader::new(reader, MAX_FRAME_BYTES, Duration::from_secs(1), mac);
        let mut names = Names::default();
        while let Ok(Some(body)) = frames.next_frame().await {
            if let Ok(frame) = codec::decode(body) {
                into_domain(&mut names, frame);
            }
        }
    });
}

/// Decodes `bytes` as one frame body, and its contents into the domain types; a frame that
/// decodes must encode again to a frame that decodes to the same contents.
pub fn decode_frame(bytes: &[u8]) {
    let Ok(frame) = codec::decode(bytes) else { return };
    if let Ok(encoded) = codec::encode(&frame, u32::MAX) {
        let again = codec::decode(&encoded)
            .unwrap_or_else(|error| panic!("a re-encoded frame does not decode: {error}"));
        assert_eq!(format!("{frame:?}"), format!("{again:?}"), "a frame changed on a round trip");
    }
    into_domain(&mut Names::default(), frame);
}

/// Runs the server's side of the handshake against a client that sends `input` and closes,
/// and the client's side against a server that answers with `input`.
pub fn handshakes(input: &[u8]) {
    block_on(async {
        let mut client = Scripted::new(input);
        let _ =
            handshake::server(&mut client, b"a fuzzing secret of enough bytes", || Some(())).await;
        let mut server = Scripted::new(input);
        let _ = handshake::client(&mut server, b"a fuzzing secret of enough bytes").await;
        let mut insecure = Scripted::new(input);
        let _ = handshake::server(&mut insecure, b"", || Some(())).await;
    });
}

/// Converts a frame's contents as the connection's dispatch does.
fn into_domain(names: &mut Names, frame: Frame<'_>) {
    match frame {
        Frame::Notify { envelope, .. } | Frame::Envelope { envelope, .. } => {
            let _ = codec::envelope_in(names, envelope);
        }
        Frame::Request { request, .. } => {
            let _ = codec::request_in(names, request);
        }
        Frame::Reply { reply, .. } => {
            let _ = codec::reply_in(reply);
        }
        Frame::Failed { error, .. } => {
            let _ = codec::error_in(names, error);
        }
        Frame::Ping { .. } | Frame::Cancel { .. } | Frame::Done { .. } => {}
    }
}

/// Runs `future` to completion on a current-thread runtime, one per call (the readers here
/// never wait: every read is ready).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime builds");
    runtime.block_on(future)
}

/// A peer that sends its script at most `step` bytes a read and then closes, and swallows
/// what it is sent.
struct Scripted<'a> {
    script: &'a [u8],
    step: usize,
}

impl<'a> Scripted<'a> {
    /// A peer that sends its whole script at once.
    fn new(script: &'a [u8]) -> Scripted<'a> {
        Scripted { script, step: usize::MAX }
    }
}

impl AsyncRead for Scripted<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let take = self.step.min(self.script.len()).min(buf.remaining());
        let (now, rest) = self.script.split_at(take);
        buf.put_slice(now);
        self.script = rest;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Scripted<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every entry point returns on empty, short and arbitrary inputs (the fuzz targets run
    /// them on many more).
    #[test]
    fn the_entry_points_return_on_small_inputs() {
        let inputs: [&[u8]; 5] =
            [b"", b"\x00", b"\x01\x00\x00\x00\x05hello", &[0xff; 80], b"CLRP\x02"];
        for input in inputs {
            read_frames(input);
            decode_frame(input);
            handshakes(input);
        }
    }
}
