//! The one way a completion's choices become a response, for the gateway and for an engine's
//! front alike: [`gather`] collects them into a whole response, [`stream`] renders them as
//! server-sent events (each choice's text streamed as [`ChoiceStream`] holds it back, a finish
//! chunk per choice, the usage chunk when asked for, then `[DONE]`). Each server adapts its own
//! events to [`ChoiceEvent`] through a [`ChoiceSource`].

use std::future::Future;

use axum::Json;
use axum::response::{IntoResponse, Response};
use tl_engine_core::logprobs::TokenLogprobs;

use kvwire_grpc::pb::engine::GenerateEvents;

use super::sse::{self, StreamEvent};
use super::{ApiError, ChoiceOut, ChoiceStream, ErrorDetail, Finish, ResponseMeta};

/// One thing that happened to a request's choices.
#[derive(Debug, PartialEq)]
pub enum ChoiceEvent {
    /// The next token of a choice.
    Token {
        /// The choice.
        choice: u32,
        /// The token.
        token: u32,
        /// Its log-probabilities, when asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// A choice ended.
    Finished {
        /// The choice.
        choice: u32,
        /// Why.
        finish: Finish,
    },
    /// The request failed: a whole response answers this error; a stream sends its detail.
    Failed(ApiError),
    /// The request broke after tokens went out: a whole response answers 502; a stream relays
    /// the detail as it is.
    Broken(ErrorDetail),
}

/// The events of one message of an engine's Generate stream, in order: its tokens, then the
/// choices that ended, then its error when it has one.
pub fn choice_events(mut msg: GenerateEvents) -> impl Iterator<Item = ChoiceEvent> {
    let error = crate::node::generate::error_of(&msg)
        .map(|s| ChoiceEvent::Failed(ApiError::from_status(&s)));
    let tokens = std::mem::take(&mut msg.tokens)
        .into_iter()
        .map(|mut t| ChoiceEvent::Token {
            choice: t.choice,
            token: t.token,
            logprobs: crate::node::generate::logprobs_of(&mut t),
        });
    let finished = msg.finished.into_iter().map(|e| ChoiceEvent::Finished {
        choice: e.choice,
        finish: crate::node::generate::reason_of(e.finish).into(),
    });
    tokens.chain(finished).chain(error)
}

/// Where a response's [`ChoiceEvent`]s come from.
pub trait ChoiceSource: Send + 'static {
    /// The next event; `None` when the source ended.
    fn next(&mut self) -> impl Future<Output = Option<ChoiceEvent>> + Send;

    /// The source ended before every choice did: the error to answer, or `None` to end a
    /// stream as if complete (an engine's front whose engine thread stopped: the gateway sees
    /// the stream cut short and fails over).
    fn cut_short(&self, stream: bool) -> Option<ApiError>;

    /// Every choice ended.
    fn finished(&mut self) {}
}

/// The whole response's choices, once each of the `n` has ended.
///
/// # Errors
/// The request's failure, or [`ChoiceSource::cut_short`]'s.
pub async fn gather(n: u32, src: &mut impl ChoiceSource) -> Result<Vec<ChoiceOut>, ApiError> {
    let mut choices = vec![ChoiceOut::default(); n as usize];
    let mut open = n;
    while open > 0 {
        match src.next().await {
            Some(ChoiceEvent::Token {
                choice,
                token,
                logprobs,
            }) => {
                let Some(c) = choices.get_mut(choice as usize) else {
                    continue;
                };
                c.tokens.push(token);
                if let Some(l) = logprobs {
                    c.logprobs.get_or_insert_with(Vec::new).push(l);
                }
            }
            Some(ChoiceEvent::Finished { choice, finish }) => {
                if let Some(c) = choices.get_mut(choice as usize) {
                    c.finish = finish;
                    open -= 1;
                }
            }
            Some(ChoiceEvent::Failed(e)) => return Err(e),
            Some(ChoiceEvent::Broken(e)) => return Err(ApiError::engine(e.message)),
            None => {
                return Err(src
                    .cut_short(false)
                    .unwrap_or_else(|| ApiError::engine("the stream ended early")));
            }
        }
    }
    src.finished();
    Ok(choices)
}

/// With tool calls: the chunk's text moved into `held` (its choice's), the chunk left with
/// none.
fn hold(meta: &ResponseMeta, c: &mut crate::api::Completion, held: &mut [String]) {
    if meta.tools.is_none() {
        return;
    }
    for ch in &mut c.choices {
        if let Some(d) = ch.delta.as_mut()
            && let Some(h) = held.get_mut(ch.index as usize)
        {
            h.push_str(&d.content.take().unwrap_or_default());
            d.content = Some(String::new());
        }
    }
}

/// The whole response of `n` choices as JSON.
///
/// # Errors
/// As [`gather`].
pub async fn whole(
    meta: &ResponseMeta,
    n: u32,
    src: &mut impl ChoiceSource,
) -> Result<Response, ApiError> {
    let choices = gather(n, src).await?;
    Ok(Json(meta.whole(choices)).into_response())
}

/// A streamed response of `n` choices (`depth` events buffered), with the usage chunk before
/// `[DONE]` when `include_usage`. The source is dropped when the stream ends or the client
/// leaves.
pub fn stream(
    meta: ResponseMeta,
    n: u32,
    mut src: impl ChoiceSource,
    include_usage: bool,
    depth: usize,
) -> Response {
    let (tx, response) = sse::channel(depth);
    tokio::spawn(async move {
        let mut streams: Vec<ChoiceStream> = (0..n)
            .map(|_| ChoiceStream::new(meta.stop.clone(), &meta.render))
            .collect();
        let mut open = n;
        let mut tokens = 0usize;
        // Tool calls go out whole, in the choice's last chunk: its text is held until then.
        let mut held: Vec<String> = vec![String::new(); n as usize];
        while open > 0 {
            let event = match src.next().await {
                Some(ChoiceEvent::Token {
                    choice,
                    token,
                    logprobs,
                }) => {
                    let Some(s) = streams.get_mut(choice as usize) else {
                        continue;
                    };
                    tokens += 1;
                    let lp = logprobs.map(|l| vec![l]);
                    let mut c = meta.chunk(s, choice, vec![token], lp, None, tokens);
                    hold(&meta, &mut c, &mut held);
                    StreamEvent::Chunk(Box::new(c))
                }
                Some(ChoiceEvent::Finished { choice, finish }) => {
                    let Some(s) = streams.get_mut(choice as usize) else {
                        continue;
                    };
                    open -= 1;
                    let mut c = meta.chunk(s, choice, vec![], None, Some(finish), tokens);
                    hold(&meta, &mut c, &mut held);
                    if meta.tools.is_some()
                        && let Some(ch) = c.choices.first_mut()
                        && let Some(d) = ch.delta.as_mut()
                    {
                        d.content = Some(std::mem::take(&mut held[choice as usize]));
                        meta.read_calls(d, &mut ch.finish_reason, choice);
                        for (i, call) in d.tool_calls.iter_mut().flatten().enumerate() {
                            call.index = Some(i as u32);
                        }
                    }
                    StreamEvent::Chunk(Box::new(c))
                }
                Some(ChoiceEvent::Failed(e)) => StreamEvent::Error(e.detail()),
                Some(ChoiceEvent::Broken(e)) => StreamEvent::Error(e),
                None => match src.cut_short(true) {
                    Some(e) => StreamEvent::Error(e.detail()),
                    None => break,
                },
            };
            // A client that left closes the response: returning drops the source, which ends
            // the request (the gateway's task, or the sequence on an engine).
            if !tx.send(&event).await || event.is_end() {
                return;
            }
        }
        if open == 0 {
            src.finished();
            // `stream_options.include_usage`: the counts, summed over the choices, in a chunk
            // of their own.
            if include_usage {
                let usage = meta.usage_chunk(tokens);
                if !tx.send(&StreamEvent::Chunk(Box::new(usage))).await {
                    return;
                }
            }
        }
        tx.send(&StreamEvent::Done).await;
    });
    response
}
