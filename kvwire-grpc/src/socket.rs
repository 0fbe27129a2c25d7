//! KV sockets whose system calls are capped, so that none holds a core for long.
//!
//! h2 asks the socket for the rest of a DATA frame in one read, which for a 2 MiB chunk is a
//! 2 MiB `recv`. On a kernel without preemption (`PREEMPT_NONE`, as cloud guests often are),
//! nothing else runs on that core until it returns. Traced on machine J (README), such receives
//! ran 7-9 ms while the control thread waited for their core, the longest 37.6 ms (on loopback,
//! probably because the ACKs the receive sends let the sender's queued segments go out within
//! it). Reading at most [`READ_CAP`] per call returns to user space, where the
//! scheduler can switch, every few tens of microseconds, for seven more system calls per chunk.
//! A sender's writes are capped the same way ([`WRITE_CAP`]), and a TLS server's socket is
//! read ahead of rustls ([`Capped::read_ahead`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BufMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// The most one read of a KV socket asks the kernel for: 256 KiB, eight reads per 2 MiB chunk.
/// Traced on machine J, such reads took about 40 µs and at most 1.44 ms. Swept on machine M
/// (README), 512 KiB to 4 MiB moved no more bytes a second.
pub const READ_CAP: usize = 256 << 10;

/// How much a TLS connection's socket is read ahead of rustls once its handshake is done: one
/// `recv` of up to this much, then rustls's reads of one record (or 4 KiB) each are served from
/// memory. As [`READ_CAP`], so no receive is longer than a plain socket's.
pub const TLS_READ_AHEAD: usize = READ_CAP;

/// A TCP stream whose reads ask the kernel for at most `read_cap` bytes each and whose writes
/// hand it at most `write_cap` (vectored writes are cut at the cap, mid-slice if need be). The
/// caller's loops (h2's, hyper's, rustls's) take a short count as any socket's and go on.
///
/// Under rustls, [`read_ahead`](Self::read_ahead) gives it a buffer (after the handshake, so an
/// unauthenticated peer holds none): from then on one `recv` fills the buffer and small reads
/// are served from it. rustls 0.23 asks its socket for at most one record a call, which on a
/// 2 MiB message is 128 system calls.
#[derive(Debug)]
pub struct Capped {
    inner: TcpStream,
    read_cap: usize,
    write_cap: usize,
    /// Bytes read ahead: `ahead[pos..end]` is not yet read by the caller.
    ahead: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl Capped {
    /// Wraps `inner` with both caps (each at least 1; `usize::MAX` passes that way through),
    /// reading straight from it until [`read_ahead`](Self::read_ahead).
    #[must_use]
    pub fn new(inner: TcpStream, read_cap: usize, write_cap: usize) -> Self {
        Self {
            inner,
            read_cap: read_cap.max(1),
            write_cap: write_cap.max(1),
            ahead: Box::default(),
            pos: 0,
            end: 0,
        }
    }

    /// From now on, reads the socket `size` bytes at a time (at most the read cap) and serves
    /// smaller reads from them; bytes already read ahead are kept.
    pub fn read_ahead(&mut self, size: usize) {
        let size = size.min(self.read_cap);
        if size <= self.ahead.len() {
            return;
        }
        let mut ahead = vec![0; size].into_boxed_slice();
        let held = self.end - self.pos;
        ahead[..held].copy_from_slice(&self.ahead[self.pos..self.end]);
        (self.ahead, self.pos, self.end) = (ahead, 0, held);
    }

    /// The stream within.
    #[must_use]
    pub fn get_ref(&self) -> &TcpStream {
        &self.inner
    }
}

/// One read of at most `cap` bytes from `inner` into `buf`.
fn poll_read_capped(
    inner: &TcpStream,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
    cap: usize,
) -> Poll<io::Result<()>> {
    loop {
        ready!(inner.poll_read_ready(cx))?;
        // `try_read_buf` fills the unfilled part in place (no zeroing) and advances `buf`.
        let mut limited = (&mut *buf).limit(cap);
        match inner.try_read_buf(&mut limited) {
            Ok(_) => return Poll::Ready(Ok(())),
            // Readiness was stale: `try_read_buf` cleared it, so poll again to register.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

impl AsyncRead for Capped {
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
            // No buffer, or a read as large as it: straight into the caller's, capped.
            if buf.remaining() >= me.ahead.len() {
                return poll_read_capped(&me.inner, cx, buf, me.read_cap);
            }
            let mut ahead = ReadBuf::new(&mut me.ahead);
            ready!(poll_read_capped(&me.inner, cx, &mut ahead, me.read_cap))?;
            (me.pos, me.end) = (0, ahead.filled().len());
        }
        // `end == pos` here only at the end of the stream: nothing is put, which says so.
        let n = buf.remaining().min(me.end - me.pos);
        buf.put_slice(&me.ahead[me.pos..me.pos + n]);
        me.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        let n = buf.len().min(me.write_cap);
        Pin::new(&mut me.inner).poll_write(cx, &buf[..n])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if me.write_cap == usize::MAX {
            return Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        }
        let mut out = [io::IoSlice::new(&[]); MAX_SLICES];
        let n = take_slices(bufs, me.write_cap, &mut out);
        Pin::new(&mut me.inner).poll_write_vectored(cx, &out[..n])
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

impl Connected for Capped {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

/// The most one write of a KV sender's socket hands the kernel: 1 MiB, two writes per 2 MiB
/// chunk. hyper writes a whole DATA frame (and what is queued behind it) in one `writev`, and on
/// loopback the kernel also delivers it to the receiving socket within that call: traced on
/// machine J (README), the pusher's writes took up to 4.65 ms of a core that a control thread
/// woken meanwhile could not have. Swept on machine M (README): 256 and 512 KiB cost the push
/// 5-20% of its rate (probably more sends, each delivered on its own; not traced), 1 MiB
/// nothing measurable.
pub const WRITE_CAP: usize = 1 << 20;

/// At most this many slices go to one vectored write (Linux takes 1,024; hyper sends 16).
const MAX_SLICES: usize = 64;

/// The first slices of `bufs` up to `cap` bytes in all, the last one cut short if need be.
fn take_slices<'b>(
    bufs: &'b [io::IoSlice<'_>],
    cap: usize,
    out: &mut [io::IoSlice<'b>; MAX_SLICES],
) -> usize {
    let (mut n, mut left) = (0, cap);
    for b in bufs.iter().filter(|b| !b.is_empty()) {
        if left == 0 || n == MAX_SLICES {
            break;
        }
        let whole: &'b [u8] = b;
        let take = whole.len().min(left);
        out[n] = io::IoSlice::new(&whole[..take]);
        n += 1;
        left -= take;
    }
    n
}

/// Dials plain TCP (`TCP_NODELAY`, within a timeout) for a tonic channel, its writes capped:
/// what a sender of multi-MiB messages should connect with in place of tonic's own connector.
#[derive(Clone, Debug)]
pub struct CappedDialer {
    /// Bound on resolving and connecting.
    pub connect_timeout: std::time::Duration,
    /// The most one write hands the kernel ([`WRITE_CAP`]).
    pub write_cap: usize,
}

type Dialed = hyper_util::rt::TokioIo<Capped>;

impl tower_service::Service<http::Uri> for CappedDialer {
    type Response = Dialed;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Dialed>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            let tcp = dial(&uri, me.connect_timeout).await?;
            Ok(hyper_util::rt::TokioIo::new(Capped::new(
                tcp,
                usize::MAX,
                me.write_cap,
            )))
        })
    }
}

/// TCP to `uri`'s host and port with `TCP_NODELAY`, or a timed-out error after `timeout`.
///
/// # Errors
/// A URI without host or port (`InvalidInput`), the connect's own error, or `TimedOut`.
pub async fn dial(uri: &http::Uri, timeout: std::time::Duration) -> io::Result<TcpStream> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
    let host = uri
        .host()
        .ok_or_else(|| bad(format!("{uri}: no host")))?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = uri
        .port_u16()
        .ok_or_else(|| bad(format!("{uri}: no port")))?;
    let tcp = tokio::time::timeout(timeout, TcpStream::connect((host, port)))
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting to {host}:{port} took over {timeout:?}"),
            )
        })??;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// The accepted connections of `listener` (with `TCP_NODELAY`), their reads capped at
/// [`READ_CAP`]: what a tonic server of multi-MiB messages should serve on plain TCP.
pub fn capped_incoming(
    listener: tokio::net::TcpListener,
) -> impl Stream<Item = io::Result<Capped>> + Send + 'static {
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .map(|s| s.map(|s| Capped::new(s, READ_CAP, usize::MAX)))
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
        let mut r = Capped::new(s, cap, usize::MAX);
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
        let mut r = Capped::new(s, READ_CAP, usize::MAX);
        assert_eq!(r.connect_info().remote_addr(), r.get_ref().peer_addr().ok());
        let mut got = vec![0u8; 5];
        r.read_exact(&mut got).await.unwrap();
        // Nothing was read ahead yet: the buffer is empty, so growing it keeps no bytes.
        assert_eq!(r.end - r.pos, 0);
        r.read_ahead(64 << 10);
        assert_eq!(r.ahead.len(), 64 << 10);
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
            if got.len() > 1 << 19 && r.ahead.len() < READ_CAP {
                r.read_ahead(usize::MAX);
                assert_eq!(r.ahead.len(), READ_CAP, "the read-ahead is capped");
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
        let mut w = Capped::new(s, usize::MAX, usize::MAX);
        assert!(w.is_write_vectored());
        w.write_all(b"kv").await.unwrap();
        w.shutdown().await.unwrap();
        assert_eq!(client.await.unwrap(), b"kv");
    }

    /// The slices one capped write passes on: empty ones skipped, the last cut at the cap, at
    /// most MAX_SLICES of them.
    #[test]
    fn slices_are_cut_at_the_cap() {
        let (a, b, c) = ([1u8; 3], [2u8; 5], [3u8; 7]);
        let bufs = [
            io::IoSlice::new(&a),
            io::IoSlice::new(&[]),
            io::IoSlice::new(&b),
            io::IoSlice::new(&c),
        ];
        let mut out = [io::IoSlice::new(&[]); MAX_SLICES];
        let n = take_slices(&bufs, 6, &mut out);
        let got: Vec<&[u8]> = out[..n].iter().map(|s| &**s).collect();
        assert_eq!(got, [&a[..], &b[..3]]);
        let n = take_slices(&bufs, 100, &mut out);
        assert_eq!(out[..n].iter().map(|s| s.len()).sum::<usize>(), 15);
        let many = vec![io::IoSlice::new(&a); MAX_SLICES + 5];
        assert_eq!(take_slices(&many, usize::MAX, &mut out), MAX_SLICES);
    }

    /// No write, plain or vectored, hands the socket more than the cap, and every byte still
    /// arrives in order; reads pass through.
    #[tokio::test]
    async fn writes_are_capped_and_lossless() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"ok").await.unwrap();
            let mut v = Vec::new();
            s.read_to_end(&mut v).await.unwrap();
            v
        });
        let cap = 4 << 10;
        let mut w = Capped::new(TcpStream::connect(addr).await.unwrap(), usize::MAX, cap);
        assert!(w.is_write_vectored());
        let mut hello = [0u8; 2];
        w.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"ok");
        assert_eq!(w.get_ref().peer_addr().unwrap(), addr);
        let sent: Vec<u8> = (0..(1 << 20) + 17).map(|i: u32| (i % 251) as u8).collect();
        // A fresh loopback socket takes far more than 4 KiB at once, so an uncapped write would
        // return more than the cap here.
        let (x, y) = sent.split_at(3000);
        let n = w
            .write_vectored(&[io::IoSlice::new(x), io::IoSlice::new(&y[..3000])])
            .await
            .unwrap();
        assert_eq!(n, cap, "the vectored write was not cut at the cap");
        let n2 = w.write(&sent[n..]).await.unwrap();
        assert_eq!(n2, cap, "the plain write was not cut at the cap");
        w.write_all(&sent[n + n2..]).await.unwrap();
        w.shutdown().await.unwrap();
        assert_eq!(reader.await.unwrap(), sent);
    }

    /// The dialer connects with TCP_NODELAY and its writes capped; a URI without a port is
    /// refused as invalid input, a closed port as the connect's own error.
    #[tokio::test]
    async fn the_dialer_connects_and_refuses_bad_uris() {
        use tower_service::Service;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut d = CappedDialer {
            connect_timeout: std::time::Duration::from_secs(2),
            write_cap: 123,
        };
        let io = d
            .call(format!("http://{addr}").parse().unwrap())
            .await
            .unwrap();
        let w = io.inner();
        assert_eq!((w.read_cap, w.write_cap), (usize::MAX, 123));
        assert!(w.get_ref().nodelay().unwrap());
        let e = d
            .call("http://127.0.0.1".parse().unwrap())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        drop(listener);
        let e = d
            .call(format!("http://{addr}").parse().unwrap())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }
}
