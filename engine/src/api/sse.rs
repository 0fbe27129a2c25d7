//! The one server-sent-events codec of the API: [`encode`] turns a [`StreamEvent`] into an event's
//! `data:` payload, [`Decoder`] turns received bytes back into events. A stream ends with a typed
//! event, [`StreamEvent::Done`] (`data: [DONE]`) or [`StreamEvent::Error`] (`data: {"error":...}`),
//! never found by searching the text.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{Completion, ErrorBody, ErrorDetail};

/// One event of a completion stream.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// A chunk of tokens (the last one carries the finish reason).
    Chunk(Box<Completion>),
    /// The stream failed after it started; nothing follows.
    Error(ErrorDetail),
    /// The stream is complete.
    Done,
}

impl StreamEvent {
    /// True for the events after which nothing follows.
    #[must_use]
    pub fn is_end(&self) -> bool {
        matches!(self, StreamEvent::Error(_) | StreamEvent::Done)
    }
}

/// The `data:` payload of `event`.
#[must_use]
pub fn encode(event: &StreamEvent) -> String {
    let json = match event {
        StreamEvent::Chunk(c) => serde_json::to_string(c),
        StreamEvent::Error(e) => serde_json::to_string(&ErrorBody { error: e.clone() }),
        StreamEvent::Done => return "[DONE]".into(),
    };
    // Serializing these plain structs cannot fail (string keys, no maps of other keys).
    json.unwrap_or_default()
}

/// Why received bytes are not a completion stream.
#[derive(Debug, thiserror::Error)]
#[error("malformed stream event {data:?}: {source}")]
pub struct DecodeError {
    /// The offending payload.
    pub data: String,
    /// serde's complaint.
    pub source: serde_json::Error,
}

/// Splits a byte stream into events. Bytes are buffered until an event's blank line, so a frame
/// boundary anywhere (inside a line, inside a UTF-8 character) is fine.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
}

impl Decoder {
    /// A decoder with nothing buffered.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds received bytes; returns the events they complete, in order.
    ///
    /// # Errors
    /// A `data:` payload that is neither `[DONE]`, an error object nor a completion chunk.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<StreamEvent>, DecodeError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    out.push(decode_data(data.trim())?);
                }
            }
        }
        Ok(out)
    }
}

fn decode_data(data: &str) -> Result<StreamEvent, DecodeError> {
    if data == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let err = |source| DecodeError {
        data: data.to_owned(),
        source,
    };
    let value: serde_json::Value = serde_json::from_str(data).map_err(err)?;
    if value.get("error").is_some() {
        let body: ErrorBody = serde_json::from_value(value).map_err(err)?;
        return Ok(StreamEvent::Error(body.error));
    }
    Ok(StreamEvent::Chunk(Box::new(
        serde_json::from_value(value).map_err(err)?,
    )))
}

/// The sending half of an SSE response: events sent here are written to the client in order.
#[derive(Clone, Debug)]
pub struct Sender(mpsc::Sender<Result<Event, Infallible>>);

impl Sender {
    /// Sends one event; `false` when the client has gone (the response was dropped).
    pub async fn send(&self, event: &StreamEvent) -> bool {
        self.0
            .send(Ok(Event::default().data(encode(event))))
            .await
            .is_ok()
    }

    /// Resolves when the client has gone.
    pub async fn closed(&self) {
        self.0.closed().await;
    }
}

/// An SSE response and the sender that feeds it (`depth` events buffered).
#[must_use]
pub fn channel(depth: usize) -> (Sender, Response) {
    let (tx, rx) = mpsc::channel(depth.max(1));
    (
        Sender(tx),
        Sse::new(ReceiverStream::new(rx)).into_response(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Flavor, ResponseMeta};

    #[test]
    fn events_round_trip_through_any_split() {
        let meta = ResponseMeta {
            id: "cmpl-1".into(),
            model: "fake".into(),
            seed: 7,
            flavor: Flavor::Chat,
            prompt_tokens: 3,
            route: None,
            stop: Default::default(),
        };
        let mut text = crate::api::ChoiceStream::default();
        let lp = tl_engine_core::logprobs::TokenLogprobs {
            token: 0xA9,
            logprob: -0.1234567,
            top: vec![(0xA9, -0.1234567), (7, -2.5e-8)],
        };
        let events = vec![
            StreamEvent::Chunk(Box::new(meta.chunk(&mut text, 0, vec![0xC3], None, None))),
            StreamEvent::Chunk(Box::new(meta.chunk(
                &mut text,
                0,
                vec![0xA9],
                Some(vec![lp]),
                None,
            ))),
            StreamEvent::Chunk(Box::new(meta.chunk(
                &mut text,
                0,
                vec![],
                None,
                Some("length".into()),
            ))),
            StreamEvent::Error(ErrorDetail {
                message: "boom".into(),
                kind: "engine_error".into(),
                code: None,
            }),
            StreamEvent::Done,
        ];
        let wire: String = events
            .iter()
            .map(|e| format!("data: {}\n\n", encode(e)))
            .collect();
        for split in [1, 2, 7, wire.len()] {
            let mut d = Decoder::new();
            let mut got = Vec::new();
            for piece in wire.as_bytes().chunks(split) {
                got.extend(d.push(piece).unwrap());
            }
            assert_eq!(got, events, "split {split}");
        }
        assert!(Decoder::new().push(b"data: {nope\n\n").is_err());
    }
}
