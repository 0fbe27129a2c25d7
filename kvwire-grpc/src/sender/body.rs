//! PushKv as a hand-made client-streaming call: the request body hands HTTP/2 each chunk as the
//! `Bytes` [`encode_message`] made of it (a block's payload lent by the store, not copied into
//! an encode buffer, which is all tonic's encoder can write to), and the answer is read as
//! tonic's client reads it (trailers-only status, one message, then the trailers).
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::encode::{AckDecoder, ChunkStream, encode_message};
use crate::glue::{self, MessageLimits};
use crate::pb::kv::KvAck;

/// The request body of a push: the chunks' messages, piece by piece, as HTTP/2 asks for them
/// (it asks only while its flow-control windows have room, so at most a window's worth of
/// blocks is lent at a time).
pub(super) struct PushBody {
    chunks: ChunkStream,
    pieces: VecDeque<Bytes>,
    max: usize,
    ended: bool,
}

impl PushBody {
    pub(super) fn new(chunks: ChunkStream, max: usize) -> Self {
        Self {
            chunks,
            pieces: VecDeque::new(),
            max,
            ended: false,
        }
    }
}

impl http_body::Body for PushBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(piece) = this.pieces.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(piece))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match this.chunks.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => this.ended = true,
                Poll::Ready(Some(item)) => {
                    if let Err(s) = encode_message(item, this.max, &mut this.pieces) {
                        this.ended = true;
                        this.pieces.clear();
                        return Poll::Ready(Some(Err(s)));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.pieces.is_empty()
    }
}

/// Calls PushKv on `channel` with the messages of `chunks`.
///
/// # Errors
/// As [`glue::unary`]: the server's status, UNAVAILABLE when the channel cannot be used, and a
/// transport failure as tonic reports it (which [`glue::bounded`] maps to UNAVAILABLE).
pub(super) async fn push(
    mut channel: Channel,
    path: &'static str,
    limits: MessageLimits,
    chunks: ChunkStream,
) -> Result<KvAck, Status> {
    use tower_service::Service;
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .version(http::Version::HTTP_2)
        .uri(path)
        .header(http::header::TE, "trailers")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(tonic::body::Body::new(PushBody::new(
            chunks,
            limits.max_encode,
        )))
        .map_err(|e| Status::internal(format!("building the PushKv request: {e}")))?;
    glue::inject_context(req.headers_mut());
    let resp = channel
        .call(req)
        .await
        .map_err(|e| Status::from_error(Box::new(e)))?;
    // A trailers-only answer: the status is in the headers and no message follows.
    if let Some(status) = Status::from_header_map(resp.headers())
        && status.code() != Code::Ok
    {
        return Err(status);
    }
    let code = resp.status();
    let mut answer = tonic::codec::Streaming::new_response(
        AckDecoder,
        resp.into_body(),
        code,
        None,
        Some(limits.max_decode),
    );
    let ack = answer
        .message()
        .await?
        .ok_or_else(|| Status::internal("Missing response message."))?;
    answer.trailers().await?;
    Ok(ack)
}
