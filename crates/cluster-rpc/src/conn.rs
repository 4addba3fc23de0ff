//! Length-delimited framing: each frame is a 4-byte big-endian length followed by that many
//! bytes of postcard ([`crate::codec`]).
//!
//! A length above the configured limit, a stream that ends inside a frame and a frame that does
//! not decode are all fatal *for that connection only*: the reader reports a [`FrameError`], the
//! connection is closed and logged, and every other connection carries on.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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
}

/// The next frame's bytes, or `None` when the peer closed the connection between frames.
///
/// Not cancel safe (a partly read frame is lost): only the connection's reader task calls it,
/// and it is only cancelled when the connection is closed.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max_frame_bytes: u32,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0_u8; 4];
    // The first byte tells a clean close (EOF here) from a truncated frame (EOF later).
    match reader.read(&mut header[..1]).await? {
        0 => return Ok(None),
        _ => reader.read_exact(&mut header[1..]).await?,
    };
    let len = u32::from_be_bytes(header);
    if len > max_frame_bytes {
        return Err(FrameError::Oversize { len, max: max_frame_bytes });
    }
    let len =
        usize::try_from(len).map_err(|_| FrameError::Oversize { len, max: max_frame_bytes })?;
    let mut body = vec![0_u8; len];
    reader.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Writes one frame whose body is `body` (already checked against the limit by the encoder):
/// the length and the body go out in one vectored write where the stream allows it, so a
/// frame is one system call and, with `TCP_NODELAY`, one segment rather than two.
///
/// Not cancel safe: only the connection's writer task calls it.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    body: &[u8],
) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame longer than 4 GiB"))?;
    let header = len.to_be_bytes();
    let mut written = 0;
    while written < header.len() {
        let parts = [io::IoSlice::new(&header[written..]), io::IoSlice::new(body)];
        let n = writer.write_vectored(&parts).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    let sent = written - header.len();
    writer.write_all(&body[sent..]).await
}

#[cfg(test)]
mod tests {
    use std::io::{self, IoSlice};
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::AsyncWrite;

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
        super::write_frame(&mut stream, body).await.unwrap();
        stream
    }

    #[tokio::test]
    async fn a_frame_is_one_write_when_the_stream_takes_it_all() {
        let stream = written(usize::MAX, b"hello").await;
        assert_eq!(stream.bytes, b"\0\0\0\x05hello");
        assert_eq!(stream.writes, 1, "the length and the body go out together");
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
