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

/// How much a TLS connection's socket is read ahead of rustls once its handshake is done: one
/// `recv` of up to this much, then rustls's reads of one record (or 4 KiB) each are served from
/// memory. As [`READ_CAP`], so no receive is longer than a plain socket's.
pub const TLS_READ_AHEAD: usize = READ_CAP;

/// A TCP stream for rustls to read: reads pass straight to the socket until
/// [`ReadAhead::read_ahead`] gives it a buffer (after the handshake, so an unauthenticated
/// peer holds none), and from then on one `recv` fills the buffer and small reads are served
/// from it. rustls 0.23 asks its socket for at most one record a call, which on a 2 MiB
/// message is 128 system calls. Writes pass through (vectored).
#[derive(Debug)]
pub struct ReadAhead {
    inner: TcpStream,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl ReadAhead {
    /// Wraps `inner`, reading straight from it for now.
    #[must_use]
    pub fn new(inner: TcpStream) -> Self {
        Self {
            inner,
            buf: Box::default(),
            pos: 0,
            end: 0,
        }
    }

    /// From now on, reads the socket `size` bytes at a time (at most [`READ_CAP`]); bytes
    /// already read ahead are kept.
    pub fn read_ahead(&mut self, size: usize) {
        let size = size.min(READ_CAP);
        if size <= self.buf.len() {
            return;
        }
        let mut buf = vec![0; size].into_boxed_slice();
        let held = self.end - self.pos;
        buf[..held].copy_from_slice(&self.buf[self.pos..self.end]);
        (self.buf, self.pos, self.end) = (buf, 0, held);
    }

    /// The stream within.
    #[must_use]
    pub fn get_ref(&self) -> &TcpStream {
        &self.inner
    }
}

impl AsyncRead for ReadAhead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if me.pos == me.end {
            // No buffer yet, or a read as large as it: straight to the caller, capped.
            if buf.remaining() >= me.buf.len() {
                return Pin::new(&mut CappedView(&mut me.inner)).poll_read(cx, buf);
            }
            loop {
                ready!(me.inner.poll_read_ready(cx))?;
                match me.inner.try_read(&mut me.buf) {
                    Ok(n) => {
                        (me.pos, me.end) = (0, n);
                        break;
                    }
                    // Readiness was stale: `try_read` cleared it, so poll again to register.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
        }
        // `end == pos` here only at the end of the stream: nothing is put, which says so.
        let n = buf.remaining().min(me.end - me.pos);
        buf.put_slice(&me.buf[me.pos..me.pos + n]);
        me.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// A borrowed socket read at most [`READ_CAP`] a call.
struct CappedView<'a>(&'a mut TcpStream);

impl AsyncRead for CappedView<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let inner = &mut *self.get_mut().0;
        loop {
            ready!(inner.poll_read_ready(cx))?;
            let mut limited = (&mut *buf).limit(READ_CAP);
            match inner.try_read_buf(&mut limited) {
                Ok(_) => return Poll::Ready(Ok(())),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Writes (vectored) and the connection's info pass straight to the `inner` socket.
macro_rules! write_through {
    ($t:ty) => {
        impl AsyncWrite for $t {
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

        impl Connected for $t {
            type ConnectInfo = TcpConnectInfo;

            fn connect_info(&self) -> TcpConnectInfo {
                self.inner.connect_info()
            }
        }
    };
}

write_through!(CappedReads);
write_through!(ReadAhead);

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

    /// Before `read_ahead` every read goes to the socket; after it, small reads are served from
    /// one large receive, every byte in order, and the end of the stream still reads as 0.
    #[tokio::test]
    async fn read_ahead_serves_small_reads_in_order_and_keeps_the_end() {
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
        let mut r = ReadAhead::new(s);
        assert_eq!(r.connect_info().remote_addr(), r.get_ref().peer_addr().ok());
        let mut got = vec![0u8; 5];
        r.read_exact(&mut got).await.unwrap();
        // Nothing was read ahead yet: the buffer is empty, so growing it keeps no bytes.
        assert_eq!(r.end - r.pos, 0);
        r.read_ahead(64 << 10);
        assert_eq!(r.buf.len(), 64 << 10);
        let mut small = [0u8; 4096];
        let mut largest = 0;
        loop {
            let n = r.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            largest = largest.max(n);
            got.extend_from_slice(&small[..n]);
            // Growing the buffer midway keeps what it holds.
            if got.len() > 1 << 19 && r.buf.len() < READ_CAP {
                r.read_ahead(usize::MAX);
                assert_eq!(r.buf.len(), READ_CAP, "the read-ahead is capped");
            }
        }
        assert!(largest <= 4096);
        assert_eq!(got, sent);
        assert_eq!(
            r.read(&mut small).await.unwrap(),
            0,
            "the end reads as 0 again"
        );
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
