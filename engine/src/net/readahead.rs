//! A read-ahead buffer under TLS.
//!
//! rustls asks its transport for at most 4 KiB at a time (`DeframerVecBuffer::prepare_read`
//! reserves `used + 4096` bytes), so a TLS stream over a bare socket makes four or more `read`
//! system calls per 16 KiB record. [`ReadAhead`] sits between the socket and rustls: one system
//! call fills up to [`READ_AHEAD`] bytes, and rustls's small reads are served from memory.
//! Writes pass straight through (vectored too, which tokio-rustls uses to flush several
//! records at once).

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes one system call may read ahead of the TLS layer: four full records.
pub const READ_AHEAD: usize = 64 << 10;

/// A byte stream whose reads go through a buffer of [`READ_AHEAD`] bytes, allocated at the
/// first read (a connection that never sends costs nothing).
#[derive(Debug)]
pub struct ReadAhead<S> {
    inner: S,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl<S> ReadAhead<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            start: 0,
            end: 0,
        }
    }

    /// The stream underneath.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Bytes read from the stream and not yet handed up.
    #[must_use]
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        if me.start == me.end {
            // A caller that asks for as much as the buffer holds reads directly.
            if out.remaining() >= READ_AHEAD {
                return Pin::new(&mut me.inner).poll_read(cx, out);
            }
            if me.buf.is_empty() {
                me.buf = vec![0; READ_AHEAD];
            }
            let mut rb = ReadBuf::new(&mut me.buf);
            ready!(Pin::new(&mut me.inner).poll_read(cx, &mut rb))?;
            me.start = 0;
            me.end = rb.filled().len();
            if me.end == 0 {
                return Poll::Ready(Ok(())); // end of stream
            }
        }
        let n = (me.end - me.start).min(out.remaining());
        out.put_slice(&me.buf[me.start..me.start + n]);
        me.start += n;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadAhead<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for ReadAhead<tokio::net::TcpStream> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Every byte arrives once and in order, through small reads, large reads and a mix, and
    /// the end of the stream is seen.
    #[tokio::test]
    async fn bytes_pass_in_order_whatever_the_read_sizes() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (a, b) = tokio::io::duplex(8 << 10);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            let mut a = a;
            a.write_all(&sent).await.unwrap();
            a.shutdown().await.unwrap();
        });
        let mut r = ReadAhead::new(b);
        let mut got = Vec::new();
        let mut sizes = [1usize, 4096, 100, READ_AHEAD, 17, 2 * READ_AHEAD]
            .iter()
            .cycle();
        loop {
            let mut chunk = vec![0u8; *sizes.next().unwrap()];
            let n = r.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        writer.await.unwrap();
        assert_eq!(got, data);
        assert_eq!(r.buffered(), 0);
    }

    /// One system call's worth is kept for the small reads after it: reading 4 KiB from a
    /// stream holding 40 KiB leaves the rest buffered.
    #[tokio::test]
    async fn a_small_read_buffers_ahead() {
        let (mut a, b) = tokio::io::duplex(READ_AHEAD);
        a.write_all(&[3u8; 40 << 10]).await.unwrap();
        let mut r = ReadAhead::new(b);
        let mut four = [0u8; 4096];
        r.read_exact(&mut four).await.unwrap();
        assert_eq!(r.buffered(), (40 << 10) - 4096);
    }
}
