//! Request bodies: prompts, the shared sampling and output fields with their bounds, the
//! chat messages, and the one field check every endpoint runs ([`parse_fields`]).

use serde::{Deserialize, Serialize};
use tl_engine_core::engine::{Choices, MAX_CHOICES};
use tl_engine_core::logprobs::MAX_TOP_LOGPROBS;
use tl_engine_core::model::BYTE_VOCAB;
use tl_engine_core::model::encode_text;
use tl_engine_core::request::Params;
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;

use super::{ApiError, Flavor};

/// The header naming a transferred KV handle on a decode engine's `/v1/completions`.
pub const KV_HANDLE_HEADER: &str = "x-tl-kv-handle";

/// The header carrying a request's tenant cache scope (hex u64) from the gateway to an engine's
/// `/v1/completions`; absent: the shared scope 0. Only the gateway and operators reach that
/// front (mutual TLS with role checks), so it is trusted there. A resume ignores it: the claimed
/// handle's scope is the one its blocks were pushed in.
pub const CACHE_SCOPE_HEADER: &str = "x-tl-cache-scope";

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
    /// vLLM's `cache_salt`: requests share cached blocks only when they share it (and the
    /// tenant). Read by the gateway into the request's cache scope; never forwarded.
    #[serde(default, skip_serializing)]
    pub cache_salt: Option<String>,
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
    /// vLLM's `ignore_eos`: go on past the checkpoint's end-of-sequence tokens. Read by the
    /// gateway (which adds those tokens to the stop ids otherwise); never forwarded.
    #[serde(default, skip_serializing)]
    pub ignore_eos: Option<bool>,
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
    "cache_salt",
    // vLLM's: go on past EOS (an engine's front, whose stop ids come from the gateway, has no
    // EOS of its own to ignore).
    "ignore_eos",
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
