//! The OpenAI-compatible HTTP API as types: requests, responses, stream chunks and errors, shared
//! by the gateway, the engines' decode front, the demo, the benches and the clients. [`sse`] is
//! the one server-sent-events codec.
//!
//! Extensions beyond OpenAI's fields: `top_k`, `seed` (echoed), `stop_token_ids`,
//! `choices[].tokens` (token ids), `choices[].tl_logprobs` (log-probabilities by token id),
//! `tl_resume` (the decode side of a transfer) and `tl_route` (where the gateway sent a request).

use self::logprobs::{ChoiceLogprobs, Offsets, TlLogprob};

pub mod logprobs;
pub mod render;
pub mod sse;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tl_engine_core::engine::{Choices, FinishReason, MAX_CHOICES};
use tl_engine_core::logprobs::{MAX_TOP_LOGPROBS, TokenLogprobs};
use tl_engine_core::model::BYTE_VOCAB;
use tl_engine_core::model::{TextStream, decode_text, encode_text};
use tl_engine_core::request::{Params, RequestError};
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;

/// The header naming a transferred KV handle on a decode engine's `/v1/completions`.
pub const KV_HANDLE_HEADER: &str = "x-tl-kv-handle";

/// OpenAI's default completion length.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// A prompt as token ids or as text (byte-level tokenizer).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Prompt {
    /// Token ids.
    Tokens(Vec<u32>),
    /// Text.
    Text(String),
}

impl Prompt {
    /// The token ids.
    #[must_use]
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(s) => encode_text(s),
        }
    }
}

/// Where a prefill engine left a request.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct TlResume {
    /// The first token, sampled by the prefill engine.
    pub first_token: u32,
    /// Draws it consumed.
    pub rng_draws_consumed: u32,
}

/// The sampling and output fields both endpoints share (OpenAI's names; [`parse_fields`] refuses
/// the others). temperature and top_p are parsed as f32, as on every other path.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct GenerationParams {
    /// Model; omitted or empty means whichever the server serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Completion length ([`DEFAULT_MAX_TOKENS`] when omitted).
    #[serde(
        default,
        alias = "max_completion_tokens",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_tokens: Option<u32>,
    /// 0 = greedy (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus mass (default 1; 0 means 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k (default 0, off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Seed; the engine picks one when omitted (required to resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk with `usage` and no choices, before `[DONE]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Stop strings: one, or up to 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopStrings>,
    /// Stop token ids (vLLM's extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Completions of the prompt, 1 to 8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// Completions: how many alternatives per token (0 to 5); chat: whether to report them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<LogprobsField>,
    /// Chat: alternatives per token (0 to 20), with `logprobs: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
}

/// OpenAI's `logprobs`: a count on completions, a flag on chat.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum LogprobsField {
    /// Chat's.
    Flag(bool),
    /// Completions'.
    Count(u32),
}

/// The most alternatives per token `/v1/completions` reports (OpenAI's limit); chat's is
/// [`MAX_TOP_LOGPROBS`], which an engine's front also takes (the gateway passes chat's on).
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// OpenAI's `stop`: a string or a list of strings.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum StopStrings {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// At most this many stop strings (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// A stop string's longest UTF-8 length, in bytes. Holding back a stream's possible stop
/// prefix costs up to `strings x bytes^2` byte comparisons per token in the worst case; 64 keeps
/// that to 16 k.
pub const MAX_STOP_BYTES: usize = 64;
/// At most this many stop token ids.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// OpenAI's `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send the usage chunk.
    #[serde(default)]
    pub include_usage: bool,
}

impl GenerationParams {
    /// The model asked for, if any (an empty name asks for none).
    #[must_use]
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref().filter(|m| !m.is_empty())
    }

    /// Completion length, defaulted.
    #[must_use]
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
    }

    /// Sampling as stated, defaulted.
    #[must_use]
    pub fn sampling(&self) -> SamplingRequest {
        SamplingRequest {
            temperature: self.temperature.unwrap_or(0.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
        }
    }

    /// The core's view of a request with this prompt, for [`Params::validate`].
    #[must_use]
    pub fn params<'a>(&self, prompt: &'a [u32]) -> Params<'a> {
        Params {
            prompt,
            max_tokens: self.max_tokens(),
            sampling: self.sampling(),
        }
    }

    /// Streaming asked for.
    #[must_use]
    pub fn streams(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// The stop rules, checked: at most [`MAX_STOP_STRINGS`] non-empty strings of at most
    /// [`MAX_STOP_BYTES`] bytes, at most [`MAX_STOP_TOKEN_IDS`] token ids inside the vocabulary.
    ///
    /// # Errors
    /// 400 naming the problem.
    pub fn stop_rules(&self) -> Result<Stop, ApiError> {
        let strings: Vec<&String> = match &self.stop {
            None => Vec::new(),
            Some(StopStrings::One(s)) => vec![s],
            Some(StopStrings::Many(v)) => v.iter().collect(),
        };
        if strings.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_request(format!(
                "`stop` has {} strings; at most {MAX_STOP_STRINGS}",
                strings.len()
            )));
        }
        if let Some(s) = strings
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::bad_request(format!(
                "`stop` strings are 1 to {MAX_STOP_BYTES} bytes; got {}",
                s.len()
            )));
        }
        let ids = self.stop_token_ids.clone().unwrap_or_default();
        if ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::bad_request(format!(
                "`stop_token_ids` has {} ids; at most {MAX_STOP_TOKEN_IDS}",
                ids.len()
            )));
        }
        if let Some(t) = ids.iter().find(|&&t| t >= BYTE_VOCAB) {
            return Err(ApiError::bad_request(format!(
                "stop token id {t} is outside the vocabulary (0..{BYTE_VOCAB})"
            )));
        }
        Ok(Stop {
            sequences: strings.iter().map(|s| s.as_bytes().to_vec()).collect(),
            token_ids: ids,
        })
    }

    /// The choices and log-probabilities asked for, checked for `flavor`'s door: completions
    /// take `logprobs: k` (k at most `completion_max`), chat `logprobs: true` with
    /// `top_logprobs: k`.
    ///
    /// # Errors
    /// 400 naming the field.
    pub fn choices(&self, flavor: Flavor, completion_max: u32) -> Result<Choices, ApiError> {
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_CHOICES).contains(&n) {
            return Err(ApiError::bad_request(format!(
                "`n` must be between 1 and {MAX_CHOICES}; got {n}"
            )));
        }
        let logprobs = match (flavor, self.logprobs, self.top_logprobs) {
            (_, None | Some(LogprobsField::Flag(false)), None) => None,
            (Flavor::Completion, Some(LogprobsField::Count(k)), None) => {
                if k > completion_max {
                    return Err(ApiError::bad_request(format!(
                        "`logprobs` is at most {completion_max}; got {k}"
                    )));
                }
                Some(k)
            }
            (Flavor::Chat, Some(LogprobsField::Flag(true)), k) => {
                let k = k.unwrap_or(0);
                if k > MAX_TOP_LOGPROBS {
                    return Err(ApiError::bad_request(format!(
                        "`top_logprobs` is at most {MAX_TOP_LOGPROBS}; got {k}"
                    )));
                }
                Some(k)
            }
            (Flavor::Chat, _, Some(_)) => {
                return Err(ApiError::bad_request(
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            (Flavor::Completion, _, _) => {
                return Err(ApiError::bad_request(format!(
                    "`logprobs` on completions is a number from 0 to {completion_max}"
                )));
            }
            (Flavor::Chat, _, None) => {
                return Err(ApiError::bad_request(
                    "`logprobs` on chat completions is true or false",
                ));
            }
        };
        Ok(Choices { n, logprobs })
    }

    /// A usage chunk asked for at the end of the stream.
    #[must_use]
    pub fn include_usage(&self) -> bool {
        self.stream_options.is_some_and(|o| o.include_usage)
    }
}

/// Fields every completion endpoint reads (besides its own: `prompt` or `messages`).
const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "n",
    "logprobs",
    // OpenAI's end-user id, for abuse monitoring: accepted, not used.
    "user",
];

/// The value of an unsupported field that asks for nothing, and so passes.
#[derive(Clone, Copy, Debug)]
enum Off {
    /// Only null.
    Never,
    /// `false` or `0`.
    FalseOrZero,
    /// `1` (one choice, `best_of` one).
    One,
}

impl Off {
    fn allows(self, v: &serde_json::Value) -> bool {
        match self {
            Off::Never => false,
            Off::FalseOrZero => v.as_bool() == Some(false) || v.as_f64() == Some(0.0),
            Off::One => v.as_f64() == Some(1.0),
        }
    }
}

/// Fields OpenAI defines that this server does not implement: refused with 400 naming the field
/// (never silently ignored), unless null or the value that means "off".
const UNSUPPORTED_FIELDS: &[(&str, Off)] = &[
    // Chat's own (a completion asking for it is told it is not supported there).
    ("top_logprobs", Off::Never),
    ("echo", Off::FalseOrZero),
    ("best_of", Off::One),
    ("suffix", Off::Never),
    ("logit_bias", Off::Never),
    ("frequency_penalty", Off::FalseOrZero),
    ("presence_penalty", Off::FalseOrZero),
    ("response_format", Off::Never),
    ("tools", Off::Never),
    ("tool_choice", Off::Never),
    ("parallel_tool_calls", Off::Never),
    ("functions", Off::Never),
    ("function_call", Off::Never),
    ("service_tier", Off::Never),
    ("store", Off::FalseOrZero),
    ("metadata", Off::Never),
    ("modalities", Off::Never),
    ("audio", Off::Never),
    ("prediction", Off::Never),
    ("reasoning_effort", Off::Never),
    ("web_search_options", Off::Never),
];

/// Parses a request body after checking its fields: `own` are the endpoint's own fields; the
/// shared ones are always read. An OpenAI field this server does not implement is 400 naming it
/// (null, or its "off" value such as `n: 1`, passes); any other field is 400 as unknown.
///
/// # Errors
/// 400 `invalid_request_error`.
pub fn parse_fields<T: serde::de::DeserializeOwned>(
    body: &[u8],
    own: &[&str],
) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("malformed request: {e}")))?;
    let Some(fields) = v.as_object() else {
        return Err(ApiError::bad_request("a request is a JSON object"));
    };
    for (k, value) in fields {
        if own.contains(&k.as_str()) || SHARED_FIELDS.contains(&k.as_str()) {
            continue;
        }
        match UNSUPPORTED_FIELDS.iter().find(|(name, _)| name == k) {
            Some((_, off)) if value.is_null() || off.allows(value) => {}
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "`{k}` is not supported by this server"
                )));
            }
            None => return Err(ApiError::bad_request(format!("unknown field `{k}`"))),
        }
    }
    if fields.get("stream_options").is_some_and(|o| !o.is_null())
        && fields.get("stream") != Some(&serde_json::Value::Bool(true))
    {
        return Err(ApiError::bad_request(
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad_request(format!("malformed request: {e}")))
}

/// The completion endpoints' own fields: the public one's, and an engine front's (which also
/// takes the resume point).
pub const COMPLETION_FIELDS: &[&str] = &["prompt"];
/// An engine's front: a completion, and the resume point of a transferred handle.
pub const ENGINE_COMPLETION_FIELDS: &[&str] = &["prompt", "tl_resume"];
/// The chat endpoint's own fields.
pub const CHAT_FIELDS: &[&str] = &["messages", "top_logprobs"];

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and output.
    #[serde(flatten)]
    pub params: GenerationParams,
    /// Resume point, with the `X-TL-KV-Handle` header (decode engines only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tl_resume: Option<TlResume>,
}

/// One chat message.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

/// `POST /v1/chat/completions` body.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Sampling and output.
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// The chat template: each message as `<|role|>\n{content}\n`, then `<|assistant|>\n`, tokenized
/// byte by byte.
#[must_use]
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&format!("<|{}|>\n{}\n", m.role, m.content));
    }
    s.push_str("<|assistant|>\n");
    s
}

/// Which endpoint a response answers: they differ in `object` and in how text is carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `/v1/completions`: `text`.
    Completion,
    /// `/v1/chat/completions`: `message` (whole) or `delta` (streamed).
    Chat,
}

/// Where the gateway sent a request (the `tl_route` extension).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct RouteInfo {
    /// Prefill worker id.
    pub prefill: String,
    /// Decode worker id (or the colocated fallback's).
    pub decode: String,
    /// Why this decode engine.
    pub reason: String,
    /// Full blocks it already held.
    pub cached_blocks: usize,
    /// Decode engines tried before this one.
    pub retries: u32,
    /// Blocks the transfer sent (null when colocated).
    pub blocks_sent: Option<u32>,
    /// Blocks the decode engine already held.
    pub blocks_deduped: Option<u32>,
    /// Envelope bytes moved.
    pub payload_bytes: Option<u64>,
}

/// A chat message as answered (whole or as a stream delta).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct AssistantText {
    /// Always `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// One choice of a response or a stream chunk.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct Choice {
    /// Which of the request's `n` choices.
    pub index: u32,
    /// Completion text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Chat answer (whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantText>,
    /// Chat answer (streamed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<AssistantText>,
    /// The token ids (extension).
    #[serde(default)]
    pub tokens: Vec<u32>,
    /// Log-probabilities, when asked for (null otherwise).
    #[serde(default)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// The same by token id (extension), when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tl_logprobs: Option<Vec<TlLogprob>>,
    /// `length` at the end; null before.
    #[serde(default)]
    pub finish_reason: Option<Finish>,
}

impl Choice {
    /// The choice for these tokens and their text, in the flavor's shape (`stream`: a chunk's
    /// delta).
    #[must_use]
    pub fn with_text(
        flavor: Flavor,
        stream: bool,
        tokens: Vec<u32>,
        text: String,
        finish: Option<Finish>,
    ) -> Self {
        let mut c = Choice {
            tokens,
            finish_reason: finish,
            ..Choice::default()
        };
        let said = AssistantText {
            role: "assistant".into(),
            content: text.clone(),
        };
        match (flavor, stream) {
            (Flavor::Completion, _) => c.text = Some(text),
            (Flavor::Chat, false) => c.message = Some(said),
            (Flavor::Chat, true) => c.delta = Some(said),
        }
        c
    }
}

/// Token counts.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

impl Usage {
    /// Counts for a prompt and a completion.
    #[must_use]
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A whole response, or one stream chunk (then without `usage`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Completion {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    pub object: String,
    /// Seconds since the epoch.
    pub created: u64,
    /// The model that answered.
    pub model: String,
    /// The seed used (extension).
    pub seed: u64,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts (whole responses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Where the gateway sent the request (gateway responses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tl_route: Option<RouteInfo>,
}

/// What every response of one request shares.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    /// The completion id.
    pub id: String,
    /// The model that answered.
    pub model: String,
    /// The seed used.
    pub seed: u64,
    /// The endpoint.
    pub flavor: Flavor,
    /// Prompt length, for usage.
    pub prompt_tokens: usize,
    /// The gateway's route, if any.
    pub route: Option<RouteInfo>,
    /// The stop rules: a matched stop string is cut from the text.
    pub stop: Stop,
}

/// A stream's text: byte tokens decoded incrementally ([`TextStream`]), with the tokens that
/// could still begin a stop string held back until the next ones decide, so that a stop string
/// is never half-sent and the concatenated chunks equal the whole response's text.
#[derive(Debug, Default)]
pub struct StreamText {
    text: TextStream,
    stop: Stop,
    /// The completion so far (bounded by `max_tokens`).
    all: Vec<u32>,
    /// Trailing tokens of `all` not yet decoded.
    held: usize,
}

impl StreamText {
    /// A stream ending on `stop`.
    #[must_use]
    pub fn new(stop: Stop) -> Self {
        Self {
            stop,
            ..Self::default()
        }
    }

    /// The text `tokens` release.
    pub fn push(&mut self, tokens: &[u32]) -> String {
        self.all.extend_from_slice(tokens);
        self.held += tokens.len();
        let keep = self
            .stop
            .pending(&self.all)
            .max(self.stop.matched(&self.all).unwrap_or(0))
            .min(self.held);
        let start = self.all.len() - self.held;
        let out = self.text.push(&self.all[start..self.all.len() - keep]);
        self.held = keep;
        out
    }

    /// The rest of the text, at the end: without the matched stop sequence when `stopped`.
    pub fn finish(&mut self, stopped: bool) -> String {
        let cut = if stopped {
            self.stop.matched(&self.all).unwrap_or(0).min(self.held)
        } else {
            0
        };
        let start = self.all.len() - self.held;
        let mut out = self.text.push(&self.all[start..self.all.len() - cut]);
        out.push_str(&self.text.finish());
        self.held = 0;
        out
    }
}

impl ResponseMeta {
    fn object(&self, stream: bool) -> &'static str {
        match (self.flavor, stream) {
            (Flavor::Completion, _) => "text_completion",
            (Flavor::Chat, false) => "chat.completion",
            (Flavor::Chat, true) => "chat.completion.chunk",
        }
    }

    fn body(&self, stream: bool, choice: Choice, usage: Option<Usage>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: self.object(stream).into(),
            created: now_secs(),
            model: self.model.clone(),
            seed: self.seed,
            choices: vec![choice],
            usage,
            tl_route: self.route.clone(),
        }
    }

    /// One stream chunk carrying choice `index`'s `tokens` (and the finish reason on its last),
    /// their text decoded by the choice's `stream` (held-back bytes of a split character go out
    /// with the token that completes them; the last chunk flushes the rest), and their
    /// log-probabilities when asked for.
    #[must_use]
    pub fn chunk(
        &self,
        stream: &mut ChoiceStream,
        index: u32,
        tokens: Vec<u32>,
        logprobs: Option<Vec<TokenLogprobs>>,
        finish: Option<Finish>,
    ) -> Completion {
        let mut s = stream.text.push(&tokens);
        if let Some(f) = finish {
            s.push_str(&stream.text.finish(f == Finish::Stop));
        }
        let offsets = stream.offsets.next(&tokens);
        let mut choice = Choice::with_text(self.flavor, true, tokens, s, finish);
        choice.index = index;
        self.attach(&mut choice, logprobs, offsets);
        self.body(true, choice, None)
    }

    fn attach(
        &self,
        choice: &mut Choice,
        logprobs: Option<Vec<TokenLogprobs>>,
        offsets: Vec<usize>,
    ) {
        if let Some(l) = logprobs {
            choice.logprobs = Some(logprobs::render(self.flavor, &l, offsets));
            choice.tl_logprobs = Some(l.into_iter().map(TlLogprob::from).collect());
        }
    }

    /// The stream's usage chunk (`stream_options.include_usage`): no choices, the counts
    /// (`completion_tokens` summed over the choices).
    #[must_use]
    pub fn usage_chunk(&self, completion_tokens: usize) -> Completion {
        let mut c = self.body(
            true,
            Choice::default(),
            Some(Usage::new(self.prompt_tokens, completion_tokens)),
        );
        c.choices.clear();
        c
    }

    /// The whole response: one choice per entry of `choices`, in order; usage sums them.
    #[must_use]
    pub fn whole(&self, choices: Vec<ChoiceOut>) -> Completion {
        let completion_tokens = choices.iter().map(|c| c.tokens.len()).sum();
        let mut body = self.body(
            false,
            Choice::default(),
            Some(Usage::new(self.prompt_tokens, completion_tokens)),
        );
        body.choices = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                // OpenAI's text ends before the stop string; the tokens stay exact.
                let cut = if c.finish == Finish::Stop {
                    self.stop.matched(&c.tokens).unwrap_or(0)
                } else {
                    0
                };
                let text = decode_text(&c.tokens[..c.tokens.len() - cut]);
                let offsets = Offsets::default().next(&c.tokens);
                let mut choice =
                    Choice::with_text(self.flavor, false, c.tokens, text, Some(c.finish));
                choice.index = i as u32;
                self.attach(&mut choice, c.logprobs, offsets);
                choice
            })
            .collect();
        body
    }
}

/// One choice of a whole response.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChoiceOut {
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// Their log-probabilities, when asked for.
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// Why it ended.
    pub finish: Finish,
}

/// One choice's stream: its text ([`StreamText`]) and its log-probabilities' text offsets.
#[derive(Debug, Default)]
pub struct ChoiceStream {
    text: StreamText,
    offsets: Offsets,
}

impl ChoiceStream {
    /// A choice's stream ending on `stop`.
    #[must_use]
    pub fn new(stop: Stop) -> Self {
        Self {
            text: StreamText::new(stop),
            offsets: Offsets::default(),
        }
    }
}

/// The `error` object of an error response or an error stream event.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorDetail {
    /// What went wrong.
    pub message: String,
    /// `invalid_request_error`, `engine_error`, `timeout`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status (whole responses only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u16>,
}

/// An error response body: `{"error": {...}}`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A refusal as an HTTP answer: the status and OpenAI's error body. Every error an HTTP door
/// returns goes through this type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The status.
    pub status: StatusCode,
    /// The `type` field.
    pub kind: &'static str,
    /// The message.
    pub message: String,
}

impl ApiError {
    /// An error with this status, type and message: only through the constructors below, one
    /// per kind, so a status and its type never disagree.
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
        }
    }

    /// 400 `invalid_request_error`: the request's own fault.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401 `invalid_request_error`: no API key, or not a known one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
    }

    /// 403 `permission_denied`: the caller's certificate role may not call this.
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_denied", message)
    }

    /// 404 `not_found`: nothing of that name (a KV handle).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 404 `model_not_found`: the model is not served here.
    pub fn model_not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "model_not_found", message)
    }

    /// 409 `conflict`: the request disagrees with what it resumes.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 429 `rate_limit`: too many requests in flight here.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit", message)
    }

    /// 429 `engine_error`: an engine's pool is full now.
    pub fn engine_busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "engine_error", message)
    }

    /// 502 `engine_error`: an engine failed the request.
    pub fn engine(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "engine_error", message)
    }

    /// 503 `engine_error`: this engine cannot run the request now.
    pub fn engine_unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "engine_error", message)
    }

    /// 503 `unavailable`: nothing can serve the request now (no engine, draining).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    /// 504 `timeout`: the request took longer than allowed.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message)
    }

    /// Its HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body as a stream event (no status code in it).
    #[must_use]
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            message: self.message.clone(),
            kind: self.kind.into(),
            code: None,
        }
    }
}

/// The one mapping of a refused request to HTTP: 400 with the core's message.
impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        Self::bad_request(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind.into(),
                code: Some(self.status.as_u16()),
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// A fresh completion id: random, so it cannot be guessed from another.
#[must_use]
pub fn completion_id() -> String {
    format!("cmpl-{:016x}", tl_engine_core::rng::entropy_seed())
}

/// Seconds since the Unix epoch, for OpenAI's `created`.
#[must_use]
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Why a choice ended, as OpenAI names it (`finish_reason`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    /// `max_tokens` reached, or the engine's context is full.
    #[default]
    Length,
    /// A stop string or stop token matched.
    Stop,
}

impl From<FinishReason> for Finish {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Length | FinishReason::Context => Finish::Length,
            FinishReason::Stop => Finish::Stop,
        }
    }
}
