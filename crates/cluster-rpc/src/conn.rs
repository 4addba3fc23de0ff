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

/// Writes one frame whose body is `body` (already checked against the limit by the encoder).
///
/// Not cancel safe: only the connection's writer task calls it.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    body: &[u8],
) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame longer than 4 GiB"))?;
    writer.write_all(&len.to_be_bytes()).await?;
    writer.write_all(body).await
}
