//! Request bodies: prompts, the shared sampling and output fields with their bounds, the
//! chat messages, and the one field check every endpoint runs ([`parse_fields`]).

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tl_engine_core::engine::{Choices, MAX_CHOICES};
use tl_engine_core::logprobs::MAX_TOP_LOGPROBS;

use tl_engine_core::model::encode_text;
use tl_engine_core::request::Params;
use tl_engine_core::sampler::SamplingRequest;
use tl_engine_core::stop::Stop;
use tl_engine_core::vocab::Vocab;

use super::{ApiError, Flavor};
use crate::structured::{Kind, Spec};

/// OpenAI's default completion length.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// A prompt, in any of the four shapes OpenAI's completions take: a string, a list of token
/// ids, a list of strings, or a list of token-id lists. The two list-of-prompts shapes ask for
/// one completion per prompt ([`Prompt::split`]).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Prompt {
    /// Token ids.
    Tokens(Vec<u32>),
    /// Text.
    Text(String),
    /// Several prompts as text.
    Texts(Vec<String>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// At most this many prompts in one request (a list of strings or of token-id lists); with `n`
/// choices each, at most [`MAX_BATCH_CHOICES`] choices in all.
pub const MAX_PROMPTS: usize = 32;
/// At most this many choices in one request over all its prompts (`prompts x n`).
pub const MAX_BATCH_CHOICES: u32 = 64;

impl Prompt {
    /// The token ids of a single prompt (text through the byte-level tokenizer); a list of
    /// prompts gives its first (use [`split`](Self::split) first).
    #[must_use]
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(s) => encode_text(s),
            Prompt::Texts(v) => v.first().map(|s| encode_text(s)).unwrap_or_default(),
            Prompt::TokenLists(v) => v.first().cloned().unwrap_or_default(),
        }
    }

    /// The single prompts this one holds, in order: itself when it is one.
    #[must_use]
    pub fn split(self) -> Vec<Prompt> {
        match self {
            Prompt::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
            Prompt::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
            one => vec![one],
        }
    }
}

/// What a prompt list may hold; the list's elements must all be of one kind.
enum PromptItem {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

const PROMPT_SHAPES: &str =
    "a string, a list of strings, a list of token ids, or a list of token-id lists";

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, a token id (0 to 2^32-1) or a list of token ids")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::custom(format!("token id {v} is out of range")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PromptItem, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("token id {v} is negative")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(t) = a.next_element::<u32>()? {
                    ids.push(t);
                }
                Ok(PromptItem::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(PROMPT_SHAPES)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Prompt, A::Error> {
                use serde::de::Error;
                let mixed = || {
                    A::Error::custom(format!(
                        "a list mixing strings, token ids and lists; a prompt is {PROMPT_SHAPES}"
                    ))
                };
                let mut out = match a.next_element::<PromptItem>()? {
                    None => return Ok(Prompt::Tokens(Vec::new())),
                    Some(PromptItem::Id(t)) => Prompt::Tokens(vec![t]),
                    Some(PromptItem::Text(s)) => Prompt::Texts(vec![s]),
                    Some(PromptItem::Ids(v)) => Prompt::TokenLists(vec![v]),
                };
                while let Some(item) = a.next_element::<PromptItem>()? {
                    match (&mut out, item) {
                        (Prompt::Tokens(v), PromptItem::Id(t)) => v.push(t),
                        (Prompt::Texts(v), PromptItem::Text(s)) => v.push(s),
                        (Prompt::TokenLists(v), PromptItem::Ids(t)) => v.push(t),
                        _ => return Err(mixed()),
                    }
                    let many = match &out {
                        Prompt::Texts(v) => v.len(),
                        Prompt::TokenLists(v) => v.len(),
                        _ => 0,
                    };
                    if many > MAX_PROMPTS {
                        return Err(A::Error::custom(format!(
                            "more than {MAX_PROMPTS} prompts in one request"
                        )));
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// OpenAI's newer name for the completion length: it wins over `max_tokens` when both are
    /// set, as in vLLM. Folded into `max_tokens` by [`normalize`](Self::normalize).
    #[serde(default, skip_serializing)]
    pub max_completion_tokens: Option<u32>,
    /// vLLM's `min_tokens`: EOS, stop token ids and stop strings end nothing before this many
    /// tokens were generated (at most `max_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<u32>,
    /// 0 = greedy (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus mass (default 1; 0 means 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k (default 0, off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// vLLM's `min_p` (default 0, off): keep the tokens at least this fraction as likely as the
    /// most likely one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// OpenAI's `presence_penalty`, in [-2, 2] (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// OpenAI's `frequency_penalty`, in [-2, 2] (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// vLLM's `repetition_penalty`, > 0 (default 1, off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// OpenAI's `logit_bias`: token id (as a string) -> bias in [-100, 100].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// OpenAI's `response_format`: text, JSON mode or a JSON schema.
    #[serde(default, skip_serializing)]
    pub response_format: Option<ResponseFormat>,
    /// vLLM's structured outputs: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
    #[serde(default, skip_serializing)]
    pub structured_outputs: Option<StructuredOutputs>,
    /// vLLM's older names for the same: a JSON schema (an object, or its JSON text).
    #[serde(default, skip_serializing)]
    pub guided_json: Option<serde_json::Value>,
    /// A regular expression the output matches.
    #[serde(default, skip_serializing)]
    pub guided_regex: Option<String>,
    /// The output is exactly one of these strings.
    #[serde(default, skip_serializing)]
    pub guided_choice: Option<Vec<String>>,
    /// A grammar in llguidance's Lark syntax.
    #[serde(default, skip_serializing)]
    pub guided_grammar: Option<String>,
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
    /// vLLM's `skip_special_tokens` (default true): leave special tokens (BOS, EOS, chat
    /// markers) out of the text. The token ids are reported either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `spaces_between_special_tokens` (default true): with `skip_special_tokens: false`,
    /// a space between a special token and the text or special token next to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
    /// OpenAI's end-user id, for abuse monitoring: accepted (bounded), not used.
    #[serde(default, skip_serializing)]
    pub user: Option<String>,
    /// OpenAI's `metadata`: up to 16 string pairs, accepted (bounded), not stored.
    #[serde(default, skip_serializing)]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// OpenAI's `response_format`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// A JSON document valid against a schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// OpenAI's `response_format.json_schema`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// Its name (required by OpenAI; not used).
    pub name: String,
    /// The schema (absent: any JSON object).
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict mode: the schema is always enforced here.
    #[serde(default)]
    pub strict: Option<bool>,
    /// Its description (not used).
    #[serde(default)]
    pub description: Option<String>,
}

/// vLLM's `structured_outputs`: exactly one of its fields.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or its JSON text).
    #[serde(default)]
    pub json: Option<serde_json::Value>,
    /// A regular expression.
    #[serde(default)]
    pub regex: Option<String>,
    /// One of these strings.
    #[serde(default)]
    pub choice: Option<Vec<String>>,
    /// A Lark grammar.
    #[serde(default)]
    pub grammar: Option<String>,
    /// Any JSON object.
    #[serde(default)]
    pub json_object: Option<bool>,
}

/// A JSON schema as vLLM takes it: an object, or a string holding one.
fn schema_spec(field: &str, v: &serde_json::Value) -> Result<Spec, ApiError> {
    let schema = match v {
        serde_json::Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::bad_field(field, format_args!("is not JSON: {e}")))?,
        other => other.clone(),
    };
    Ok(Spec::json_schema(&schema))
}

/// OpenAI's bounds on `metadata`: pairs, key length, value length (characters).
pub const MAX_METADATA: (usize, usize, usize) = (16, 64, 512);
/// The longest `user` taken, in bytes.
pub const MAX_USER_BYTES: usize = 256;

/// OpenAI's `logprobs`: a count on completions, a flag on chat.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(
    untagged,
    expecting = "a number from 0 (completions) or true or false (chat completions)"
)]
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
#[serde(untagged, expecting = "a string or a list of strings")]
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

/// OpenAI's `stream_options`, with vLLM's `continuous_usage_stats`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send the usage chunk.
    #[serde(default)]
    pub include_usage: bool,
    /// vLLM's: with `include_usage`, every chunk also carries the usage so far.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continuous_usage_stats: bool,
}

impl GenerationParams {
    /// The model asked for, if any (an empty name asks for none).
    #[must_use]
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref().filter(|m| !m.is_empty())
    }

    /// Completion length, defaulted: `max_completion_tokens`, else `max_tokens`, else
    /// [`DEFAULT_MAX_TOKENS`].
    #[must_use]
    pub fn max_tokens(&self) -> u32 {
        self.max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS)
    }

    /// Checks the fields no type can (`min_tokens`, `user`, `metadata`) and folds
    /// `max_completion_tokens` into `max_tokens`, so what is forwarded says one length.
    ///
    /// # Errors
    /// 400 naming the field.
    pub fn normalize(&mut self) -> Result<(), ApiError> {
        self.max_tokens = Some(self.max_tokens());
        self.max_completion_tokens = None;
        if let Some(m) = self.min_tokens
            && m > self.max_tokens()
        {
            return Err(ApiError::bad_field(
                "min_tokens",
                format!("({m}) is more than max_tokens ({})", self.max_tokens()),
            ));
        }
        if let Some(u) = &self.user
            && u.len() > MAX_USER_BYTES
        {
            return Err(ApiError::bad_field(
                "user",
                format!("is longer than {MAX_USER_BYTES} bytes"),
            ));
        }
        // 0 is the wire's "unset"; a request that states it asks for nothing vLLM accepts.
        if let Some(r) = self.repetition_penalty
            && (r.is_nan() || r <= 0.0)
        {
            return Err(ApiError::bad_field(
                "repetition_penalty",
                format!("must be > 0; got {r}"),
            ));
        }
        if let Some(bias) = &self.logit_bias
            && let Some(k) = bias.keys().find(|k| k.parse::<u32>().is_err())
        {
            return Err(ApiError::bad_field(
                format!("logit_bias.{k}"),
                "keys are token ids (\"0\" to \"4294967295\")",
            ));
        }
        let (pairs, key, value) = MAX_METADATA;
        if let Some(m) = &self.metadata {
            if m.len() > pairs {
                return Err(ApiError::bad_field(
                    "metadata",
                    format!("has {} pairs; at most {pairs}", m.len()),
                ));
            }
            for (k, v) in m {
                if k.chars().count() > key || v.chars().count() > value {
                    return Err(ApiError::bad_field(
                        format!("metadata.{k}"),
                        format!("is too long: keys are at most {key} characters, values {value}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// How text is rendered from the tokens: specials left out unless `skip_special_tokens`
    /// is false, then spaced unless `spaces_between_special_tokens` is false.
    #[must_use]
    pub fn specials(&self) -> Specials {
        match (self.skip_special_tokens, self.spaces_between_special_tokens) {
            (Some(false), Some(false)) => Specials::Shown { spaced: false },
            (Some(false), _) => Specials::Shown { spaced: true },
            _ => Specials::Skipped,
        }
    }

    /// Sampling as stated, defaulted. `logit_bias`'s keys were checked to be token ids by
    /// [`normalize`](Self::normalize).
    #[must_use]
    pub fn sampling(&self) -> SamplingRequest {
        let off = SamplingRequest::default();
        SamplingRequest {
            temperature: self.temperature.unwrap_or(off.temperature),
            top_p: self.top_p.unwrap_or(off.top_p),
            top_k: self.top_k.unwrap_or(off.top_k),
            min_p: self.min_p.unwrap_or(off.min_p),
            presence_penalty: self.presence_penalty.unwrap_or(off.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(off.frequency_penalty),
            repetition_penalty: self.repetition_penalty.unwrap_or(off.repetition_penalty),
            logit_bias: self
                .logit_bias
                .iter()
                .flatten()
                .filter_map(|(k, &b)| Some((k.parse().ok()?, b)))
                .collect(),
        }
    }

    /// What the output must match, if anything: at most one of `response_format` (other than
    /// text), `structured_outputs` and the `guided_*` fields.
    ///
    /// # Errors
    /// 400 naming the field: two asked for at once, or a spec that cannot be read.
    pub fn structured(&self) -> Result<Option<(String, Spec)>, ApiError> {
        let mut found: Vec<(String, Spec)> = Vec::new();
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => found.push((
                "response_format".into(),
                Spec {
                    kind: Kind::JsonObject,
                    text: String::new(),
                },
            )),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema
                    .schema
                    .clone()
                    .unwrap_or_else(|| serde_json::json!({ "type": "object" }));
                found.push((
                    "response_format.json_schema.schema".into(),
                    Spec::json_schema(&schema),
                ));
            }
        }
        if let Some(s) = &self.structured_outputs {
            let at = |f: &str| format!("structured_outputs.{f}");
            if let Some(j) = &s.json {
                found.push((at("json"), schema_spec(&at("json"), j)?));
            }
            if let Some(r) = &s.regex {
                found.push((at("regex"), Spec::regex(r)));
            }
            if let Some(c) = &s.choice {
                let spec = Spec::choice(c).map_err(|e| ApiError::bad_field(at("choice"), e))?;
                found.push((at("choice"), spec));
            }
            if let Some(g) = &s.grammar {
                found.push((at("grammar"), Spec::lark(g)));
            }
            if s.json_object == Some(true) {
                found.push((
                    at("json_object"),
                    Spec {
                        kind: Kind::JsonObject,
                        text: String::new(),
                    },
                ));
            }
        }
        if let Some(j) = &self.guided_json {
            found.push(("guided_json".into(), schema_spec("guided_json", j)?));
        }
        if let Some(r) = &self.guided_regex {
            found.push(("guided_regex".into(), Spec::regex(r)));
        }
        if let Some(c) = &self.guided_choice {
            let spec = Spec::choice(c).map_err(|e| ApiError::bad_field("guided_choice", e))?;
            found.push(("guided_choice".into(), spec));
        }
        if let Some(g) = &self.guided_grammar {
            found.push(("guided_grammar".into(), Spec::lark(g)));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
            return Err(ApiError::bad_field(
                names[1],
                format_args!(
                    "cannot be asked for with `{}`: one constraint at a time",
                    names[0]
                ),
            ));
        }
        Ok(found.pop())
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
    pub fn stop_rules(&self, vocab: &Arc<Vocab>) -> Result<Stop, ApiError> {
        let strings: Vec<&String> = match &self.stop {
            None => Vec::new(),
            Some(StopStrings::One(s)) => vec![s],
            Some(StopStrings::Many(v)) => v.iter().collect(),
        };
        if strings.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_field(
                "stop",
                format!("has {} strings; at most {MAX_STOP_STRINGS}", strings.len()),
            ));
        }
        if let Some((i, s)) = strings
            .iter()
            .enumerate()
            .find(|(_, s)| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            let at = match &self.stop {
                Some(StopStrings::Many(_)) => format!("stop[{i}]"),
                _ => "stop".to_owned(),
            };
            return Err(ApiError::bad_field(
                at,
                format!("strings are 1 to {MAX_STOP_BYTES} bytes; got {}", s.len()),
            ));
        }
        let ids = self.stop_token_ids.clone().unwrap_or_default();
        if ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::bad_field(
                "stop_token_ids",
                format!("has {} ids; at most {MAX_STOP_TOKEN_IDS}", ids.len()),
            ));
        }
        let n = vocab.len();
        if let Some((i, t)) = ids.iter().enumerate().find(|(_, t)| **t as usize >= n) {
            return Err(ApiError::bad_field(
                format!("stop_token_ids[{i}]"),
                format!("({t}) is outside the vocabulary (0..{n})"),
            ));
        }
        Ok(Stop {
            sequences: strings.iter().map(|s| s.as_bytes().to_vec()).collect(),
            token_ids: ids,
            min_tokens: self.min_tokens.unwrap_or(0),
            vocab: Arc::clone(vocab),
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
            return Err(ApiError::bad_field(
                "n",
                format!("must be between 1 and {MAX_CHOICES}; got {n}"),
            ));
        }
        let logprobs = match (flavor, self.logprobs, self.top_logprobs) {
            (_, None | Some(LogprobsField::Flag(false)), None) => None,
            (Flavor::Completion, Some(LogprobsField::Count(k)), None) => {
                if k > completion_max {
                    return Err(ApiError::bad_field(
                        "logprobs",
                        format!("is at most {completion_max}; got {k}"),
                    ));
                }
                Some(k)
            }
            (Flavor::Chat, Some(LogprobsField::Flag(true)), k) => {
                let k = k.unwrap_or(0);
                if k > MAX_TOP_LOGPROBS {
                    return Err(ApiError::bad_field(
                        "top_logprobs",
                        format!("is at most {MAX_TOP_LOGPROBS}; got {k}"),
                    ));
                }
                Some(k)
            }
            (Flavor::Chat, _, Some(_)) => {
                return Err(ApiError::bad_field(
                    "top_logprobs",
                    "needs `logprobs: true`",
                ));
            }
            (Flavor::Completion, _, _) => {
                return Err(ApiError::bad_field(
                    "logprobs",
                    format!("on completions is a number from 0 to {completion_max}"),
                ));
            }
            (Flavor::Chat, _, None) => {
                return Err(ApiError::bad_field(
                    "logprobs",
                    "on chat completions is true or false",
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

    /// Usage so far in every chunk (vLLM's `continuous_usage_stats`, with `include_usage`).
    #[must_use]
    pub fn continuous_usage(&self) -> bool {
        self.stream_options
            .is_some_and(|o| o.include_usage && o.continuous_usage_stats)
    }
}

/// Whether special tokens appear in a response's text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Specials {
    /// Left out (vLLM's default, `skip_special_tokens: true`).
    #[default]
    Skipped,
    /// Written by name; `spaced`: with a space between each and its neighbours.
    Shown {
        /// `spaces_between_special_tokens`.
        spaced: bool,
    },
}

/// Fields every completion endpoint reads (besides its own: `prompt` or `messages`).
const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "seed",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "n",
    "logprobs",
    // OpenAI's end-user id and request metadata: accepted (bounded), not used.
    "user",
    "metadata",
    "cache_salt",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
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
    ("functions", Off::Never),
    ("function_call", Off::Never),
    ("service_tier", Off::Never),
    ("store", Off::FalseOrZero),
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
pub fn parse_fields<T: serde::de::DeserializeOwned + Body>(
    body: &[u8],
    own: &[&str],
) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("malformed request: {e}")))?;
    let Some(fields) = v.as_object() else {
        return Err(ApiError::bad_request("a request is a JSON object"));
    };
    let mut shared = serde_json::Map::new();
    for (k, value) in fields {
        if SHARED_FIELDS.contains(&k.as_str()) {
            shared.insert(k.clone(), value.clone());
            continue;
        }
        if own.contains(&k.as_str()) {
            continue;
        }
        match UNSUPPORTED_FIELDS.iter().find(|(name, _)| name == k) {
            Some((_, off)) if value.is_null() || off.allows(value) => {}
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "`{k}` is not supported by this server"
                ))
                .at(k));
            }
            None => return Err(ApiError::bad_request(format!("unknown field `{k}`")).at(k)),
        }
    }
    if fields.get("stream_options").is_some_and(|o| !o.is_null())
        && fields.get("stream") != Some(&serde_json::Value::Bool(true))
    {
        return Err(ApiError::bad_field(
            "stream_options",
            "is only allowed when `stream` is true",
        ));
    }
    // The shared fields alone first: a flattened struct's errors carry no path, these do.
    // (Chat's `top_logprobs` is its own field but lives in the params: the whole parse below
    // reads it.)
    from_value_at::<GenerationParams>(serde_json::Value::Object(shared))?;
    let mut body: T = from_value_at(v)?;
    body.params_mut().normalize()?;
    body.check()?;
    Ok(body)
}

/// A request body [`parse_fields`] reads: its shared fields, and the checks of its own.
pub trait Body {
    /// The shared fields.
    fn params_mut(&mut self) -> &mut GenerationParams;
    /// The endpoint's own checks, after parsing.
    ///
    /// # Errors
    /// 400 naming the field.
    fn check(&self) -> Result<(), ApiError> {
        Ok(())
    }
}

impl Body for CompletionRequest {
    fn params_mut(&mut self) -> &mut GenerationParams {
        &mut self.params
    }

    fn check(&self) -> Result<(), ApiError> {
        let prompts = match &self.prompt {
            Prompt::Texts(v) => v.len(),
            Prompt::TokenLists(v) => v.len(),
            _ => 1,
        };
        let n = self.params.n.unwrap_or(1);
        if prompts as u32 * n > MAX_BATCH_CHOICES {
            return Err(ApiError::bad_field(
                "prompt",
                format!(
                    "holds {prompts} prompts: with n = {n}, more than {MAX_BATCH_CHOICES} \
                     choices in one request"
                ),
            ));
        }
        Ok(())
    }
}

impl Body for ChatRequest {
    fn params_mut(&mut self) -> &mut GenerationParams {
        &mut self.params
    }

    /// Text parts only: an image or audio part is refused by its place.
    fn check(&self) -> Result<(), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_field("messages", "is empty: no messages"));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if let Content::Parts(parts) = &m.content {
                for (j, p) in parts.iter().enumerate() {
                    if p.kind != "text" {
                        return Err(ApiError::bad_field(
                            format!("messages[{i}].content[{j}].type"),
                            format!("`{}` is not supported; only `text` parts are", p.kind),
                        ));
                    }
                    if p.text.is_none() {
                        return Err(ApiError::bad_field(
                            format!("messages[{i}].content[{j}].text"),
                            "is missing: a text part needs its text",
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// `v` as a `T`; a shape error names the field it is in (`messages[2].content`).
fn from_value_at<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            ApiError::bad_request(format!("malformed request: {inner}"))
        } else {
            ApiError::bad_field(path, inner)
        }
    })
}

/// The completion endpoints' own fields: the public one's, and an engine front's (which also
/// takes the resume point).
pub const COMPLETION_FIELDS: &[&str] = &["prompt"];
/// The chat endpoint's own fields.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and output.
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// One chat message.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text: a string, a list of content parts, or null (an assistant turn with none).
    #[serde(default, deserialize_with = "content_or_null")]
    pub content: Content,
}

impl ChatMessage {
    /// A message of plain text.
    #[must_use]
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: Content::Text(content.to_owned()),
        }
    }

    /// Its text: a string as it is; text parts joined by newlines, as vLLM joins them.
    #[must_use]
    pub fn text(&self) -> String {
        match &self.content {
            Content::Text(s) => s.clone(),
            Content::Parts(p) => p
                .iter()
                .filter_map(|p| p.text.as_deref())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

fn content_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Content, D::Error> {
    Ok(Option::<Content>::deserialize(d)?.unwrap_or_default())
}

/// OpenAI's message `content`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged, expecting = "a string or a list of content parts")]
pub enum Content {
    /// A string.
    Text(String),
    /// Parts (`{"type": "text", "text": ...}`; others are refused by [`Body::check`]).
    Parts(Vec<ContentPart>),
}

impl From<&str> for Content {
    fn from(s: &str) -> Self {
        Content::Text(s.to_owned())
    }
}

impl Default for Content {
    fn default() -> Self {
        Content::Text(String::new())
    }
}

/// One part of a message's content.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ContentPart {
    /// `text`, `image_url`, `input_audio`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// A text part's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// `POST /v1/chat/completions` body.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// OpenAI's `tools`: functions the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<super::tools::Tool>>,
    /// OpenAI's `tool_choice`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<super::tools::ToolChoice>,
    /// OpenAI's `parallel_tool_calls` (default true): false allows one call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
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
        s.push_str(&format!("<|{}|>\n{}\n", m.role, m.text()));
    }
    s.push_str("<|assistant|>\n");
    s
}
