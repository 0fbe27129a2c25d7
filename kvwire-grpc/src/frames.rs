//! A client-streaming call read without tonic's copy.
//!
//! tonic's `Streaming` appends every HTTP/2 DATA frame to a buffer of its own before it decodes a
//! message: for a 2 MiB push chunk that is a 2 MiB copy on the receiving side, before the import
//! copies the same bytes into the pool. A sender over HTTP/2 with a large `max_frame_size` (the
//! server advertises 16 MiB) sends each chunk as one DATA frame, which h2 hands up as one
//! `Bytes`. [`RequestStream`] keeps the frames as they came and cuts each message out of its
//! frame by reference; only a message that spans frames is gathered, into one buffer (as tonic
//! would). prost then decodes `bytes` fields from that `Bytes` by reference too.
//!
//! The framing and its refusals are tonic's: a 5-byte prefix (a compression flag of 0 and a
//! big-endian length); a message over the limit is OUT_OF_RANGE and a compressed one (no
//! compression is offered) INTERNAL, with tonic's messages.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Frame;
use tonic::Status;
use tonic::body::Body;

use crate::glue::{MessageLimits, ResponseFuture};

/// The gRPC message prefix: the compression flag and the length.
const PREFIX: usize = 5;

/// DATA frames shorter than this are appended to one buffer (copied, as tonic copies every
/// frame) instead of kept by reference: a peer that sends a message in 1-byte frames then costs
/// its bytes, not a list entry and a pinned read buffer per byte.
const SMALL_FRAME: usize = 16 << 10;

/// The messages of a client-streaming call, decoded as `Req`.
pub struct RequestStream<Req> {
    body: Body,
    frames: VecDeque<Bytes>,
    /// Small frames since the last large one, in order, after `frames`.
    small: BytesMut,
    /// Bytes in `frames` and `small`.
    buffered: usize,
    /// Bytes needed before the next message can be cut: its prefix, then prefix and body.
    want: usize,
    /// The most entries `frames` has held (for the bound's test).
    most_entries: usize,
    max: usize,
    ended: bool,
    _req: std::marker::PhantomData<fn() -> Req>,
}

impl<Req> std::fmt::Debug for RequestStream<Req> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestStream")
            .field("buffered", &self.buffered)
            .field("max", &self.max)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl<Req: prost::Message + Default> RequestStream<Req> {
    /// Reads the messages of `body`, each at most `max` bytes.
    #[must_use]
    pub fn new(body: Body, max: usize) -> Self {
        Self {
            body,
            frames: VecDeque::new(),
            small: BytesMut::new(),
            buffered: 0,
            want: PREFIX,
            most_entries: 0,
            max,
            ended: false,
            _req: std::marker::PhantomData,
        }
    }

    /// The next message, or `None` at the end of the stream.
    ///
    /// # Errors
    /// The stream's own error (a reset, a cancelled call), a message over the limit
    /// (OUT_OF_RANGE), a compressed or truncated one, or bytes that do not decode (INTERNAL).
    pub async fn message(&mut self) -> Result<Option<Req>, Status> {
        loop {
            // The small frames are gathered only when a step can be taken, so the list holds
            // at most the large frames and two gathered runs a message.
            if self.buffered >= self.want {
                self.flush_small();
                if let Some(message) = self.cut()? {
                    return Req::decode(message)
                        .map(Some)
                        .map_err(|e| Status::internal(e.to_string()));
                }
            }
            if self.ended {
                return if self.buffered == 0 {
                    Ok(None)
                } else {
                    Err(Status::internal("Unexpected EOF decoding stream."))
                };
            }
            let frame = std::future::poll_fn(|cx| self.poll_frame(cx)).await;
            match frame {
                None => self.ended = true,
                Some(Err(status)) => return Err(status),
                Some(Ok(frame)) => {
                    // Trailers of a request carry nothing for us.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.buffered += data.len();
                        if data.len() < SMALL_FRAME {
                            self.small.extend_from_slice(&data);
                        } else {
                            self.flush_small();
                            self.push(data);
                        }
                    }
                }
            }
        }
    }

    /// Moves the gathered small frames to the end of the list, as one entry.
    fn flush_small(&mut self) {
        if !self.small.is_empty() {
            let run = self.small.split().freeze();
            self.push(run);
        }
    }

    fn push(&mut self, bytes: Bytes) {
        self.frames.push_back(bytes);
        self.most_entries = self.most_entries.max(self.frames.len());
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        http_body::Body::poll_frame(Pin::new(&mut self.body), cx)
    }

    /// The next whole message's bytes, when they have all arrived.
    fn cut(&mut self) -> Result<Option<Segments>, Status> {
        if self.buffered < PREFIX {
            return Ok(None);
        }
        let mut head = [0u8; PREFIX];
        self.peek(&mut head);
        match head[0] {
            0 => {}
            1 => {
                return Err(Status::internal(
                    "protocol error: received message with compressed-flag but no grpc-encoding was specified",
                ));
            }
            f => {
                return Err(Status::internal(format!(
                    "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
                )));
            }
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > self.max {
            return Err(Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, the limit is: {} bytes",
                self.max
            )));
        }
        if self.buffered < PREFIX + len {
            self.want = PREFIX + len;
            return Ok(None);
        }
        self.want = PREFIX;
        self.take(PREFIX);
        Ok(Some(self.take_segments(len)))
    }

    /// The first `n` buffered bytes as the frames (or parts of frames) that hold them, by
    /// reference: a message sent as several frames (the push sends the fields before a block,
    /// the block, and the fields after it as three) is decoded across them without gathering.
    fn take_segments(&mut self, n: usize) -> Segments {
        self.buffered -= n;
        let mut parts = VecDeque::new();
        let mut need = n;
        while need > 0 {
            let Some(first) = self.frames.front_mut() else {
                break;
            };
            if first.len() <= need {
                need -= first.len();
                parts.extend(self.frames.pop_front());
            } else {
                parts.push_back(first.split_to(need));
                need = 0;
            }
        }
        Segments {
            remaining: n - need,
            parts,
        }
    }

    /// Copies the first `out.len()` buffered bytes (the caller checked they are there).
    fn peek(&self, out: &mut [u8]) {
        let mut at = 0;
        for f in &self.frames {
            let n = (out.len() - at).min(f.len());
            out[at..at + n].copy_from_slice(&f[..n]);
            at += n;
            if at == out.len() {
                return;
            }
        }
    }

    /// The first `n` buffered bytes: a slice of the first frame when it holds them all, else
    /// gathered into one buffer.
    fn take(&mut self, n: usize) -> Bytes {
        self.buffered -= n;
        if let Some(first) = self.frames.front_mut()
            && first.len() >= n
        {
            let out = first.split_to(n);
            if first.is_empty() {
                self.frames.pop_front();
            }
            return out;
        }
        let mut out = BytesMut::with_capacity(n);
        while out.len() < n {
            let Some(first) = self.frames.front_mut() else {
                break;
            };
            let k = (n - out.len()).min(first.len());
            out.extend_from_slice(&first[..k]);
            first.advance(k);
            if first.is_empty() {
                self.frames.pop_front();
            }
        }
        out.freeze()
    }
}

/// One message's bytes in the frames that brought them. prost reads a `bytes` field with
/// [`Buf::copy_to_bytes`], which here is a slice of the frame when the field lies within one:
/// so a block's payload that came as a frame of its own is never copied.
#[derive(Debug)]
struct Segments {
    parts: VecDeque<Bytes>,
    remaining: usize,
}

impl Buf for Segments {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |b| &b[..])
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the message's end");
        self.remaining -= cnt;
        while cnt > 0 {
            let Some(first) = self.parts.front_mut() else {
                return;
            };
            if first.len() > cnt {
                first.advance(cnt);
                return;
            }
            cnt -= first.len();
            self.parts.pop_front();
        }
        // A part may be left empty by an exact advance; `chunk` must not return it while more
        // bytes follow.
        while self.parts.front().is_some_and(Bytes::is_empty) {
            self.parts.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.remaining, "copy past the message's end");
        if let Some(first) = self.parts.front_mut()
            && first.len() >= len
        {
            let out = first.split_to(len);
            self.remaining -= len;
            if first.is_empty() {
                self.parts.pop_front();
            }
            return out;
        }
        let mut out = BytesMut::with_capacity(len);
        out.put((&mut *self).take(len));
        out.freeze()
    }
}

/// A body of given frames, sent in order: a response's message and its trailers.
struct Frames(VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

/// The HTTP response for a handler's answer: the message then `grpc-status: 0`, or the status
/// alone (trailers-only). A message over `max_encode` is OUT_OF_RANGE instead.
fn answer<Resp: prost::Message>(
    r: Result<Resp, Status>,
    max_encode: usize,
) -> http::Response<Body> {
    let msg = match r {
        Ok(m) if m.encoded_len() <= max_encode => m,
        Ok(m) => {
            return Status::out_of_range(format!(
                "Error, encoded message length too large: found {} bytes, the limit is: {max_encode} bytes",
                m.encoded_len()
            ))
            .into_http();
        }
        Err(status) => return status.into_http(),
    };
    let len = msg.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.extend_from_slice(&[0]);
    buf.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    // Encoding into a buffer reserved for the whole message cannot fail.
    let _ = msg.encode(&mut buf);
    let mut trailers = http::HeaderMap::new();
    trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
    let mut resp = http::Response::new(Body::new(Frames(VecDeque::from([
        Frame::data(buf.freeze()),
        Frame::trailers(trailers),
    ]))));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// Answers one client-streaming call with `handler`, which reads the request stream as a
/// [`RequestStream`] (messages cut out of their DATA frames by reference) within `limits`.
pub fn serve_client_streaming<Req, Resp, F, Fut>(
    req: http::Request<Body>,
    limits: MessageLimits,
    handler: F,
) -> ResponseFuture
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: FnOnce(RequestStream<Req>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Resp, Status>> + Send + 'static,
{
    Box::pin(async move {
        // No compression is offered: a request that says it uses one is refused, as tonic
        // refuses an encoding it does not accept.
        if let Some(enc) = req.headers().get("grpc-encoding")
            && enc.as_bytes() != b"identity"
        {
            let msg = format!(
                "Content is compressed with `{}` which isn't supported",
                String::from_utf8_lossy(enc.as_bytes())
            );
            return Ok(Status::unimplemented(msg).into_http());
        }
        let stream = RequestStream::new(req.into_body(), limits.max_decode);
        Ok(answer(handler(stream).await, limits.max_encode))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::kv::KvChunk;
    use prost::Message;

    /// A request body of these DATA frames.
    fn data(frames: impl IntoIterator<Item = Bytes>) -> Body {
        Body::new(Frames(frames.into_iter().map(Frame::data).collect()))
    }

    fn framed(m: &KvChunk) -> Vec<u8> {
        let mut v = vec![0u8];
        v.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
        v.extend_from_slice(&m.encode_to_vec());
        v
    }

    fn stream(frames: Vec<Vec<u8>>, max: usize) -> RequestStream<KvChunk> {
        RequestStream::new(data(frames.into_iter().map(Bytes::from)), max)
    }

    fn chunk(i: u32, n: usize) -> KvChunk {
        KvChunk {
            handle_id: "h".into(),
            index: i,
            payload: Bytes::from(vec![i as u8; n]),
            ..KvChunk::default()
        }
    }

    /// A message in one large frame is cut from it by reference: its payload points into the
    /// frame.
    #[tokio::test]
    async fn a_message_in_one_frame_is_not_copied() {
        let wire = Bytes::from(framed(&chunk(1, 64 << 10)));
        let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
        let mut s = RequestStream::<KvChunk>::new(data([wire]), 1 << 20);
        let m = s.message().await.unwrap().unwrap();
        assert_eq!(m.payload.len(), 64 << 10);
        assert!(range.contains(&(m.payload.as_ptr() as usize)));
        assert!(s.message().await.unwrap().is_none());
    }

    /// A message sent as the push sends one (the fields before the payload, the payload, the
    /// fields after, three frames) is decoded with its payload still in the payload's frame;
    /// a second message right behind it too, and a payload split in two is gathered.
    #[tokio::test]
    async fn a_payload_in_a_frame_of_its_own_is_not_copied() {
        let m = KvChunk {
            model: "m".into(),
            tokens: vec![1, 2, 3],
            payload_crc32c: 7,
            ..chunk(2, 64 << 10)
        };
        let wire = framed(&m);
        let n = m.payload.len();
        // The payload's offset in the framed message: it ends `after` bytes before the end.
        let after = {
            let tail = KvChunk {
                model: m.model.clone(),
                tokens: m.tokens.clone(),
                payload_crc32c: m.payload_crc32c,
                ..KvChunk::default()
            };
            tail.encoded_len()
        };
        let at = wire.len() - after - n;
        let split = |w: &[u8]| {
            vec![
                Bytes::copy_from_slice(&w[..at]),
                Bytes::copy_from_slice(&w[at..at + n]),
                Bytes::copy_from_slice(&w[at + n..]),
            ]
        };
        let mut frames = split(&wire);
        frames.extend(split(&wire));
        let payloads: Vec<_> = [&frames[1], &frames[4]]
            .iter()
            .map(|f| f.as_ptr() as usize)
            .collect();
        let mut s = RequestStream::<KvChunk>::new(data(frames), 1 << 20);
        for want in payloads {
            let got = s.message().await.unwrap().unwrap();
            assert_eq!(got, m);
            assert_eq!(
                got.payload.as_ptr() as usize,
                want,
                "the payload was copied"
            );
        }
        assert!(s.message().await.unwrap().is_none());
        // The payload in two large frames: gathered, and still the same message.
        let half = at + n / 2;
        let frames = vec![
            Bytes::copy_from_slice(&wire[..half]),
            Bytes::copy_from_slice(&wire[half..]),
        ];
        let mut s = RequestStream::<KvChunk>::new(data(frames), 1 << 20);
        assert_eq!(s.message().await.unwrap().unwrap(), m);
        assert!(s.message().await.unwrap().is_none());
    }

    /// Messages split across frames anywhere (inside the prefix too), and several in one
    /// frame, all come out whole and in order.
    #[tokio::test]
    async fn messages_split_anywhere_come_out_whole() {
        let msgs: Vec<KvChunk> = (0..5).map(|i| chunk(i, 100 + 37 * i as usize)).collect();
        let wire: Vec<u8> = msgs.iter().flat_map(framed).collect();
        for step in [1usize, 3, 5, 64, 1000, wire.len()] {
            let frames = wire.chunks(step).map(<[u8]>::to_vec).collect();
            let mut s = stream(frames, 1 << 20);
            for want in &msgs {
                assert_eq!(
                    s.message().await.unwrap().as_ref(),
                    Some(want),
                    "step {step}"
                );
            }
            assert!(s.message().await.unwrap().is_none());
        }
    }

    /// A message sent in 1-byte frames comes out whole, and the frame list stays short: the
    /// small frames were gathered, not kept one entry each.
    #[tokio::test]
    async fn tiny_frames_do_not_grow_the_frame_list() {
        let m = chunk(3, 100_000);
        let wire = framed(&m);
        let mut s = stream(wire.chunks(1).map(<[u8]>::to_vec).collect(), 1 << 20);
        assert_eq!(s.message().await.unwrap().as_ref(), Some(&m));
        assert!(s.message().await.unwrap().is_none());
        assert!(s.most_entries <= 2, "{} entries", s.most_entries);
        // Large frames are kept by reference, one entry each.
        let mut s = stream(
            wire.chunks(SMALL_FRAME).map(<[u8]>::to_vec).collect(),
            1 << 20,
        );
        assert_eq!(s.message().await.unwrap().as_ref(), Some(&m));
        assert!(s.most_entries >= 2);
    }

    /// The refusals and their codes: over the limit (before the body arrives), compressed,
    /// a bad flag, a stream that ends inside a message, and bytes that are not a message.
    #[tokio::test]
    async fn refusals_have_tonics_codes() {
        let big = framed(&chunk(0, 2000));
        let mut s = stream(vec![big[..PREFIX].to_vec()], 1000);
        assert_eq!(
            s.message().await.unwrap_err().code(),
            tonic::Code::OutOfRange
        );
        let mut compressed = framed(&chunk(0, 10));
        compressed[0] = 1;
        let mut s = stream(vec![compressed.clone()], 1000);
        assert_eq!(s.message().await.unwrap_err().code(), tonic::Code::Internal);
        compressed[0] = 7;
        let mut s = stream(vec![compressed], 1000);
        assert_eq!(s.message().await.unwrap_err().code(), tonic::Code::Internal);
        let whole = framed(&chunk(0, 10));
        let mut s = stream(vec![whole[..whole.len() - 1].to_vec()], 1000);
        assert_eq!(s.message().await.unwrap_err().code(), tonic::Code::Internal);
        let mut s = stream(vec![vec![0, 0, 0, 0, 2, 0xff, 0xff]], 1000);
        assert_eq!(s.message().await.unwrap_err().code(), tonic::Code::Internal);
    }
}
