//! Accepted KV sockets whose reads are capped, so that no receive holds a core for long.
//!
//! h2 asks the socket for the rest of a DATA frame in one read, which for a 2 MiB chunk is a
//! 2 MiB `recv`. On a kernel without preemption (`PREEMPT_NONE`, as cloud guests often are),
//! nothing else runs on that core until it returns. Traced on machine J (README), such receives
//! ran 7-9 ms while the control thread waited for their core, the longest 37.6 ms (on loopback,
//! probably because the ACKs the receive sends let the sender's queued segments go out within
//! it). Reading at most [`READ_CAP`] per call returns to user space, where the
//! scheduler can switch, every few tens of microseconds, for seven more system calls per chunk.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BufMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// The most one read of a KV socket asks the kernel for: 256 KiB, eight reads per 2 MiB chunk.
/// Traced on machine J, such reads took about 40 µs and at most 1.44 ms.
pub const READ_CAP: usize = 256 << 10;

/// A TCP stream whose reads ask for at most `cap` bytes each; writes pass through (vectored).
#[derive(Debug)]
pub struct CappedReads {
    inner: TcpStream,
    cap: usize,
}

impl CappedReads {
    /// Wraps `inner`, reading at most `cap` bytes per call (at least 1).
    #[must_use]
    pub fn new(inner: TcpStream, cap: usize) -> Self {
        Self {
            inner,
            cap: cap.max(1),
        }
    }

    /// The stream within.
    #[must_use]
    pub fn get_ref(&self) -> &TcpStream {
        &self.inner
    }
}

impl AsyncRead for CappedReads {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let me = self.get_mut();
        loop {
            ready!(me.inner.poll_read_ready(cx))?;
            // `try_read_buf` fills the unfilled part in place (no zeroing) and advances `buf`.
            let mut limited = (&mut *buf).limit(me.cap);
            match me.inner.try_read_buf(&mut limited) {
                Ok(_) => return Poll::Ready(Ok(())),
                // Readiness was stale: `try_read_buf` cleared it, so poll again to register.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for CappedReads {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for CappedReads {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

/// The accepted connections of `listener` (with `TCP_NODELAY`), their reads capped at
/// [`READ_CAP`]: what a tonic server of multi-MiB messages should serve on plain TCP.
pub fn capped_incoming(
    listener: tokio::net::TcpListener,
) -> impl Stream<Item = io::Result<CappedReads>> + Send + 'static {
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .map(|s| s.map(|s| CappedReads::new(s, READ_CAP)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One read never asks for more than the cap, and every byte still arrives in order.
    #[tokio::test]
    async fn reads_are_capped_and_lossless() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent: Vec<u8> = (0..(1 << 20) + 17).map(|i: u32| (i % 251) as u8).collect();
        let to_send = sent.clone();
        let writer = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(&to_send).await.unwrap();
            c.shutdown().await.unwrap();
        });
        let (s, _) = listener.accept().await.unwrap();
        // Loopback delivers segments of up to 64 KiB at once, so with a 4 KiB cap some reads
        // find more queued than they may take, and an uncapped read would take it all.
        let cap = 4 << 10;
        let mut r = CappedReads::new(s, cap);
        assert_eq!(r.connect_info().remote_addr(), r.get_ref().peer_addr().ok());
        let mut got = Vec::with_capacity(sent.len());
        let mut buf = vec![0u8; 1 << 20];
        let mut largest = 0;
        loop {
            let n = r.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            largest = largest.max(n);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(
            largest, cap,
            "a read was larger than the cap, or none reached it"
        );
        assert_eq!(got, sent);
        writer.await.unwrap();
    }

    /// Writes pass through, vectored as the stream within is.
    #[tokio::test]
    async fn writes_pass_through() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let mut v = Vec::new();
            c.read_to_end(&mut v).await.unwrap();
            v
        });
        let (s, _) = listener.accept().await.unwrap();
        let mut w = CappedReads::new(s, 0);
        assert!(w.is_write_vectored());
        w.write_all(b"kv").await.unwrap();
        w.shutdown().await.unwrap();
        assert_eq!(client.await.unwrap(), b"kv");
    }
}
