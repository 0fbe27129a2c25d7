//! Responses: whole completions and stream chunks, their choices and usage, the text each
//! choice streams, and why a choice ended.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tl_engine_core::engine::FinishReason;
use tl_engine_core::logprobs::TokenLogprobs;
use tl_engine_core::model::TextStream;
use tl_engine_core::stop::Stop;
use tl_engine_core::vocab::Vocab;

use super::Specials;
use super::logprobs::{self, ChoiceLogprobs, Offsets, TlLogprob};

/// How a response writes its tokens as text: each token's bytes as the vocabulary gives them,
/// decoded as UTF-8, and special tokens left out or written by name, as the request's
/// `skip_special_tokens` and `spaces_between_special_tokens` say.
#[derive(Clone, Debug)]
pub struct TextRender {
    /// Left out or shown.
    pub specials: Specials,
    /// What each token id stands for.
    pub vocab: Arc<Vocab>,
}

impl Default for TextRender {
    /// Specials skipped, over the fake model's byte vocabulary.
    fn default() -> Self {
        Self {
            specials: Specials::Skipped,
            vocab: Vocab::bytes(),
        }
    }
}

impl TextRender {
    /// Over `vocab`, specials skipped.
    #[must_use]
    pub fn new(vocab: Arc<Vocab>) -> Self {
        Self {
            specials: Specials::Skipped,
            vocab,
        }
    }

    /// The same vocabulary with `specials`.
    #[must_use]
    pub fn with(&self, specials: Specials) -> Self {
        Self {
            specials,
            vocab: Arc::clone(&self.vocab),
        }
    }
}

/// Token ids to text as they stream, with special tokens as [`TextRender`] says. Shown, a
/// special ends the byte run before it (an incomplete character there is U+FFFD) and is
/// written by name; spaced, a space goes between every two neighbouring pieces (a special, or
/// a run of other tokens), as vLLM's detokenizer joins them.
#[derive(Clone, Debug, Default)]
pub struct Detok {
    render: TextRender,
    bytes: TextStream,
    /// What the last piece was: none yet, text, or a special.
    last: Option<bool>,
}

impl Detok {
    /// A detokenizer rendering as `render` says.
    #[must_use]
    pub fn new(render: TextRender) -> Self {
        Self {
            render,
            ..Self::default()
        }
    }

    /// The text `tokens` complete.
    pub fn push(&mut self, tokens: &[u32]) -> String {
        let mut out = String::new();
        for &t in tokens {
            let special = self.render.vocab.is_special(t);
            match (self.render.specials, special) {
                (Specials::Skipped, true) => {}
                (Specials::Skipped, false) => {
                    out.push_str(&self.bytes.push_bytes(self.render.vocab.piece(t)));
                }
                (Specials::Shown { spaced }, false) => {
                    if spaced && self.last == Some(true) {
                        out.push(' ');
                    }
                    self.last = Some(false);
                    out.push_str(&self.bytes.push_bytes(self.render.vocab.piece(t)));
                }
                (Specials::Shown { spaced }, true) => {
                    out.push_str(&self.bytes.finish());
                    if spaced && self.last.is_some() {
                        out.push(' ');
                    }
                    self.last = Some(true);
                    out.push_str(&String::from_utf8_lossy(self.render.vocab.piece(t)));
                }
            }
        }
        out
    }

    /// The text the first `keep` bytes of token `t` complete (a stop string begins after them).
    pub fn push_part(&mut self, t: u32, keep: usize) -> String {
        if keep == 0 {
            return String::new();
        }
        let piece = self.render.vocab.text_bytes(t);
        let piece = &piece[..keep.min(piece.len())];
        let mut out = String::new();
        if matches!(self.render.specials, Specials::Shown { spaced: true })
            && self.last == Some(true)
        {
            out.push(' ');
        }
        self.last = Some(false);
        out.push_str(&self.bytes.push_bytes(piece));
        out
    }

    /// What was held back, at the end.
    pub fn finish(&mut self) -> String {
        self.bytes.finish()
    }
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
    /// The text (null in an answer that calls tools).
    pub content: Option<String>,
    /// The tools it calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<super::tools::ToolCall>>,
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
            content: Some(text.clone()),
            tool_calls: None,
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
    /// How tokens become text.
    pub render: TextRender,
    /// vLLM's `continuous_usage_stats`: every stream chunk carries the usage so far.
    pub continuous_usage: bool,
    /// The answer's text is tool calls of this mode (chat with `tool_choice` required or a
    /// named function).
    pub tools: Option<super::tools::ToolMode>,
}

/// A stream's text: tokens decoded incrementally ([`Detok`]), with the tokens that
/// could still begin a stop string held back until the next ones decide, so that a stop string
/// is never half-sent and the concatenated chunks equal the whole response's text.
#[derive(Debug, Default)]
pub struct StreamText {
    text: Detok,
    stop: Stop,
    /// The completion so far (bounded by `max_tokens`).
    all: Vec<u32>,
    /// Trailing tokens of `all` not yet decoded.
    held: usize,
}

impl StreamText {
    /// A stream ending on `stop`, its text rendered as `render` says.
    #[must_use]
    pub fn new(stop: Stop, render: TextRender) -> Self {
        Self {
            stop,
            text: Detok::new(render),
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
            .max(self.stop.matched(&self.all).map_or(0, |m| m.tokens))
            .min(self.held);
        let start = self.all.len() - self.held;
        let out = self.text.push(&self.all[start..self.all.len() - keep]);
        self.held = keep;
        out
    }

    /// The rest of the text, at the end: ending where the matched stop sequence begins when
    /// `stopped`.
    pub fn finish(&mut self, stopped: bool) -> String {
        let matched = if stopped {
            self.stop.matched(&self.all)
        } else {
            None
        };
        let cut = matched.map_or(0, |m| m.tokens.min(self.held));
        let start = self.all.len() - self.held;
        let end = self.all.len() - cut;
        let mut out = self.text.push(&self.all[start..end]);
        if let Some(m) = matched
            && cut > 0
        {
            out.push_str(&self.text.push_part(self.all[end], m.keep));
        }
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
    ///
    /// `so_far` is the tokens generated over all choices, this chunk's included: with
    /// [`continuous_usage`](Self::continuous_usage) the chunk carries it as its usage.
    #[must_use]
    pub fn chunk(
        &self,
        stream: &mut ChoiceStream,
        index: u32,
        tokens: Vec<u32>,
        logprobs: Option<Vec<TokenLogprobs>>,
        finish: Option<Finish>,
        so_far: usize,
    ) -> Completion {
        let mut s = stream.text.push(&tokens);
        if let Some(f) = finish {
            s.push_str(&stream.text.finish(f == Finish::Stop));
        }
        let offsets = stream.offsets.next(&tokens);
        let mut choice = Choice::with_text(self.flavor, true, tokens, s, finish);
        choice.index = index;
        self.attach(&mut choice, logprobs, offsets);
        let usage = self
            .continuous_usage
            .then(|| Usage::new(self.prompt_tokens, so_far));
        self.body(true, choice, usage)
    }

    fn attach(
        &self,
        choice: &mut Choice,
        logprobs: Option<Vec<TokenLogprobs>>,
        offsets: Vec<usize>,
    ) {
        if let Some(l) = logprobs {
            choice.logprobs = Some(logprobs::render(self.flavor, &l, offsets, &self.render));
            choice.tl_logprobs = Some(l.into_iter().map(TlLogprob::from).collect());
        }
    }

    /// With [`tools`](Self::tools): `said`'s text read as tool calls, which replace it (and
    /// `finish` becomes `tool_calls`); text that holds none (cut short) stays text.
    pub fn read_calls(&self, said: &mut AssistantText, finish: &mut Option<Finish>, choice: u32) {
        let Some(mode) = &self.tools else {
            return;
        };
        let text = said.content.as_deref().unwrap_or_default();
        if let Some((words, calls)) = super::tools::calls(mode, text, &self.id, choice) {
            said.content = words;
            said.tool_calls = Some(calls);
            *finish = Some(Finish::ToolCalls);
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
                // OpenAI's text ends before the stop string; the tokens stay exact. The
                // stream's text code, run once over all the tokens: the two never differ.
                let mut t = StreamText::new(self.stop.clone(), self.render.clone());
                let mut text = t.push(&c.tokens);
                text.push_str(&t.finish(c.finish == Finish::Stop));
                let offsets = Offsets::new(self.render.clone()).next(&c.tokens);
                let mut choice =
                    Choice::with_text(self.flavor, false, c.tokens, text, Some(c.finish));
                choice.index = i as u32;
                self.attach(&mut choice, c.logprobs, offsets);
                if let Some(m) = choice.message.as_mut() {
                    self.read_calls(m, &mut choice.finish_reason, i as u32);
                }
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
    /// A choice's stream ending on `stop`, rendered as `render` says.
    #[must_use]
    pub fn new(stop: Stop, render: &TextRender) -> Self {
        Self {
            text: StreamText::new(stop, render.clone()),
            offsets: Offsets::new(render.clone()),
        }
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
    /// The answer calls tools.
    #[serde(rename = "tool_calls")]
    ToolCalls,
}

impl From<FinishReason> for Finish {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Length | FinishReason::Context => Finish::Length,
            FinishReason::Stop => Finish::Stop,
        }
    }
}
