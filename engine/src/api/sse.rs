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
#[non_exhaustive]
pub enum DecodeError {
    /// A `data:` payload that is neither `[DONE]`, an error object nor a completion chunk.
    #[error("malformed stream event {data:?}: {source}")]
    Malformed {
        /// The offending payload.
        data: String,
        /// serde's complaint.
        source: serde_json::Error,
    },
    /// An event grew past the decoder's bound before its blank line arrived.
    #[error("a stream event exceeds {limit} bytes")]
    TooLarge {
        /// The bound, in bytes.
        limit: usize,
    },
}

/// The largest event a [`Decoder`] buffers by default: far above any chunk this project sends
/// (one token per choice, with at most 20 alternatives each, for at most 8 choices).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Splits a byte stream into events. Bytes are buffered until an event's blank line, so a frame
/// boundary anywhere (inside a line, inside a UTF-8 character) is fine. An event longer than the
/// bound is an error, never an ever-growing buffer, and each received byte is scanned for the
/// blank line once (plus one byte of overlap), not again on every push.
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for `\n\n` without finding one.
    scanned: usize,
    max_event: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::with_max_event(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl Decoder {
    /// A decoder with nothing buffered, bounded by [`DEFAULT_MAX_EVENT_BYTES`].
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder refusing any event longer than `max_event` bytes.
    #[must_use]
    pub fn with_max_event(max_event: usize) -> Self {
        Self {
            buf: Vec::new(),
            scanned: 0,
            max_event: max_event.max(2),
        }
    }

    /// Feeds received bytes; returns the events they complete, in order.
    ///
    /// # Errors
    /// A `data:` payload that is neither `[DONE]`, an error object nor a completion chunk, or an
    /// event longer than the bound.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<StreamEvent>, DecodeError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            // The blank line may straddle the previous push: step back one byte.
            let from = self.scanned.saturating_sub(1);
            let Some(at) = self.buf[from..].windows(2).position(|w| w == b"\n\n") else {
                self.scanned = self.buf.len();
                if self.buf.len() > self.max_event {
                    return Err(DecodeError::TooLarge {
                        limit: self.max_event,
                    });
                }
                return Ok(out);
            };
            let end = from + at;
            if end > self.max_event {
                return Err(DecodeError::TooLarge {
                    limit: self.max_event,
                });
            }
            let text = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            self.buf.drain(..end + 2);
            self.scanned = 0;
            for line in text.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    out.push(decode_data(data.trim())?);
                }
            }
        }
    }
}

fn decode_data(data: &str) -> Result<StreamEvent, DecodeError> {
    if data == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let err = |source| DecodeError::Malformed {
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
            tools: None,
            id: "cmpl-1".into(),
            model: "fake".into(),
            seed: 7,
            flavor: Flavor::Chat,
            prompt_tokens: 3,
            route: None,
            stop: Default::default(),
            render: Default::default(),
            continuous_usage: false,
        };
        let mut text = crate::api::ChoiceStream::default();
        let lp = tl_engine_core::logprobs::TokenLogprobs {
            token: 0xA9,
            logprob: -0.1234567,
            top: vec![(0xA9, -0.1234567), (7, -2.5e-8)],
        };
        let events = vec![
            StreamEvent::Chunk(Box::new(meta.chunk(
                &mut text,
                0,
                vec![0xC3],
                None,
                None,
                1,
            ))),
            StreamEvent::Chunk(Box::new(meta.chunk(
                &mut text,
                0,
                vec![0xA9],
                Some(vec![lp]),
                None,
                2,
            ))),
            StreamEvent::Chunk(Box::new(meta.chunk(
                &mut text,
                0,
                vec![],
                None,
                Some(crate::api::Finish::Length),
                2,
            ))),
            StreamEvent::Error(ErrorDetail {
                message: "boom".into(),
                kind: crate::api::ErrorKind::Engine.as_str().into(),
                param: None,
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
        assert!(matches!(
            Decoder::new().push(b"data: {nope\n\n"),
            Err(DecodeError::Malformed { .. })
        ));
    }

    #[test]
    fn an_event_past_the_bound_is_refused_and_the_buffer_stays_bounded() {
        // A peer that never sends the blank line: refused once past the bound, whatever the
        // push sizes, with at most one push of excess buffered.
        for piece in [1usize, 7, 100, 5000] {
            let mut d = Decoder::with_max_event(4096);
            let junk = vec![b'x'; piece];
            let mut fed = 0;
            let err = loop {
                match d.push(&junk) {
                    Ok(ev) => assert!(ev.is_empty()),
                    Err(e) => break e,
                }
                fed += piece;
                assert!(
                    fed <= 4096,
                    "piece {piece}: {fed} bytes buffered without an error"
                );
            };
            assert!(
                matches!(err, DecodeError::TooLarge { limit: 4096 }),
                "{err}"
            );
        }
        // An event exactly at the bound passes; one byte over fails, even when its blank line
        // arrives in the same push.
        let ok = format!("data: {}\n\n", encode(&StreamEvent::Done));
        let mut d = Decoder::with_max_event(ok.len() - 2);
        assert_eq!(d.push(ok.as_bytes()).unwrap(), vec![StreamEvent::Done]);
        let mut d = Decoder::with_max_event(ok.len() - 3);
        assert!(matches!(
            d.push(ok.as_bytes()),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_blank_line_split_across_pushes_is_found() {
        let mut d = Decoder::new();
        assert!(d.push(b"data: [DONE]\n").unwrap().is_empty());
        assert_eq!(d.push(b"\n").unwrap(), vec![StreamEvent::Done]);
        // Two events in one push, then a third split byte by byte.
        let two = b"data: [DONE]\n\ndata: [DONE]\n\n";
        assert_eq!(d.push(two).unwrap().len(), 2);
        let mut got = Vec::new();
        for b in b"data: [DONE]\n\n" {
            got.extend(d.push(&[*b]).unwrap());
        }
        assert_eq!(got, vec![StreamEvent::Done]);
    }
}
