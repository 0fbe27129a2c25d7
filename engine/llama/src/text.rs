//! A checkpoint's text side, as Hugging Face publishes it: `tokenizer.json` through the
//! `tokenizers` crate, the special tokens and chat template of `tokenizer_config.json` (or
//! `chat_template.jinja` beside it) rendered with `minijinja`, and the end-of-sequence ids of
//! `generation_config.json`. Also the byte-level tokenizer files `tl model init` writes.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// Why a checkpoint's text files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file is missing or unreadable.
    #[error("{path}: {why}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The tokenizer refused the input, or its file.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template does not parse or does not render.
    #[error("chat template: {0}")]
    Template(String),
    /// The chat template went past one of its bounds ([`RenderBounds`]).
    #[error("chat template: {0}")]
    Bound(String),
    /// The server could not render at all (its render process did not start): a fault of the
    /// server, never of the request.
    #[error("the server cannot render chat templates now: {0}")]
    Server(String),
}

/// What one render of a chat template may take: a checkpoint's template is code, and a
/// request's messages are its input, so both are bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderBounds {
    /// Template instructions (minijinja's fuel): a loop that never ends runs out of it.
    pub fuel: u64,
    /// Bytes of rendered text.
    pub max_bytes: usize,
}

impl Default for RenderBounds {
    /// 5 million instructions (a ChatML template takes about 20 a message) and 16 MiB.
    fn default() -> Self {
        Self {
            fuel: 5_000_000,
            max_bytes: 16 << 20,
        }
    }
}

/// A writer that refuses to hold more than `left` more bytes.
struct Bounded {
    out: Vec<u8>,
    left: usize,
    over: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.left {
            self.over = true;
            return Err(std::io::Error::other("output bound"));
        }
        self.left -= buf.len();
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One chat message.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// Its text.
    pub content: String,
}

/// A checkpoint's chat template, parsed, with the BOS and EOS strings it is given and the
/// bounds each render runs within. It is all a render needs, so a process of its own can
/// rebuild it from [`source`](Self::source), [`bos`](Self::bos) and [`eos`](Self::eos).
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos: Option<String>,
    eos: Option<String>,
    bounds: RenderBounds,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bytes", &self.source.len())
            .field("bounds", &self.bounds)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Parses `source` (a broken template is refused here, never at a request).
    ///
    /// # Errors
    /// A template minijinja cannot parse.
    pub fn new(
        source: String,
        bos: Option<String>,
        eos: Option<String>,
        bounds: RenderBounds,
    ) -> Result<Self, TextError> {
        let mut env = chat_env_base();
        env.set_fuel(Some(bounds.fuel));
        env.add_template_owned("chat", source.clone())
            .map_err(|e| TextError::Template(e.to_string()))?;
        Ok(Self {
            env,
            source,
            bos,
            eos,
            bounds,
        })
    }

    /// The template's text.
    #[must_use]
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` it is given.
    #[must_use]
    pub fn bos(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    /// The `eos_token` it is given.
    #[must_use]
    pub fn eos(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// The bounds each render runs within.
    #[must_use]
    pub fn bounds(&self) -> RenderBounds {
        self.bounds
    }

    /// The same template rendered within `bounds`.
    #[must_use]
    pub fn with_bounds(mut self, bounds: RenderBounds) -> Self {
        self.bounds = bounds;
        self.env.set_fuel(Some(bounds.fuel));
        self
    }

    /// `messages` rendered as `apply_chat_template(..., tokenize=False)` renders them, with
    /// `bos_token`, `eos_token` and `add_generation_prompt` defined and `raise_exception`
    /// failing the render with the template's message. A render that runs out of
    /// instructions or writes more than `max_bytes` is stopped and refused
    /// ([`TextError::Bound`]). Memory a template takes without writing it (a string doubled
    /// in a loop) is not bounded here: a process of its own bounds that.
    ///
    /// # Errors
    /// A template that fails on these messages, or one past a bound.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_tools(messages, None, add_generation_prompt)
    }

    /// As [`render`](Self::render), with the request's `tools` (OpenAI's list, as given) in
    /// the template's `tools`, as transformers' `apply_chat_template` passes them.
    ///
    /// # Errors
    /// As [`render`](Self::render).
    pub fn render_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TextError::Template(e.to_string()))?;
        let mut out = Bounded {
            out: Vec::new(),
            left: self.bounds.max_bytes,
            over: false,
        };
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools.map(minijinja::Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.out)
                .map_err(|_| TextError::Template("rendered text that is not UTF-8".into())),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(TextError::Bound(
                format!("ran past its bound of {} instructions", self.bounds.fuel),
            )),
            Err(_) if out.over => Err(TextError::Bound(format!(
                "rendered past its bound of {} bytes",
                self.bounds.max_bytes
            ))),
            Err(e) => Err(TextError::Template(e.to_string())),
        }
    }
}

/// A tokenizer: Hugging Face's (a `tokenizer.json`), or a SentencePiece vocabulary from a GGUF
/// file.
enum Tok {
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<crate::spm::Spm>),
}

/// A checkpoint's tokenizer, special tokens, chat template and EOS ids.
pub struct Text {
    tok: Tok,
    /// The chat template, parsed at load, with its bounds set.
    template: Option<ChatTemplate>,
    bos: Option<String>,
    eos: Option<String>,
    eos_ids: Vec<u32>,
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Text")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eos_ids", &self.eos_ids)
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TextError> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| TextError::File {
                path: path.to_owned(),
                why: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TextError::File {
            path: path.to_owned(),
            why: e.to_string(),
        }),
    }
}

/// A special token as `tokenizer_config.json` gives it: a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// An id or a list of ids.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl Text {
    /// Loads `dir`'s `tokenizer.json` (required), and `tokenizer_config.json`,
    /// `chat_template.jinja` and `generation_config.json` where present. EOS ids come from
    /// `generation_config.json`, else `config.json`, else the tokenizer's `eos_token`.
    ///
    /// # Errors
    /// A missing `tokenizer.json`, a file that is not JSON, or a tokenizer it cannot build.
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        if crate::gguf::is_gguf(dir) {
            return Self::from_gguf(dir);
        }
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(TextError::File {
                path,
                why: "not found (a checkpoint served as text needs its tokenizer)".into(),
            });
        }
        let tok = tokenizers::Tokenizer::from_file(&path).map_err(|e| TextError::File {
            path: path.clone(),
            why: e.to_string(),
        })?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let jinja = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja) {
            Ok(t) => Some(t),
            Err(_) => match tc.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one named "default".
                Some(Value::Array(a)) => a
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
                _ => None,
            },
        };
        let bos = token_string(tc.get("bos_token"));
        let eos = token_string(tc.get("eos_token"));
        let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        let mut eos_ids = ids(generation.get("eos_token_id"));
        if eos_ids.is_empty() {
            let config = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);
            eos_ids = ids(config.get("eos_token_id"));
        }
        if eos_ids.is_empty() {
            eos_ids.extend(eos.as_deref().and_then(|e| tok.token_to_id(e)));
        }
        // The template's end of turn ends a completion too.
        if let Some(t) = &template {
            let specials = tok
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, a)| a.special)
                .map(|(id, a)| (id, a.content));
            for id in crate::turns::end_of_turn(t, specials) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        // Parsed once here: a broken template is refused at load, and no request parses it.
        let template = template
            .map(|t| ChatTemplate::new(t, bos.clone(), eos.clone(), RenderBounds::default()))
            .transpose()?;
        Ok(Self {
            tok: Tok::Hf(Box::new(tok)),
            template,
            bos,
            eos,
            eos_ids,
        })
    }

    /// The text side a GGUF file carries: its tokenizer rebuilt from `tokenizer.ggml.*`, its
    /// chat template, BOS and EOS.
    ///
    /// # Errors
    /// A file the GGUF parser refuses, or a tokenizer it cannot rebuild, named.
    pub fn from_gguf(path: &Path) -> Result<Self, TextError> {
        let file = |why: String| TextError::File {
            path: path.to_owned(),
            why,
        };
        let g = crate::gguf::Gguf::open(path).map_err(|e| file(e.to_string()))?;
        let parts = crate::gguf::text_parts(&g).map_err(|e| file(e.to_string()))?;
        let tok = match parts.tokenizer {
            crate::gguf::Tokenizer::Json(json) => Tok::Hf(Box::new(
                tokenizers::Tokenizer::from_bytes(json.as_bytes())
                    .map_err(|e| file(format!("the tokenizer rebuilt from its metadata: {e}")))?,
            )),
            crate::gguf::Tokenizer::Spm(spm) => Tok::Spm(spm),
        };
        let template = parts
            .template
            .map(|t| {
                ChatTemplate::new(
                    t,
                    parts.bos.clone(),
                    parts.eos.clone(),
                    RenderBounds::default(),
                )
            })
            .transpose()?;
        Ok(Self {
            tok,
            template,
            bos: parts.bos,
            eos: parts.eos,
            eos_ids: parts.eos_ids,
        })
    }

    /// Token ids of `text`; `add_special_tokens` as `transformers` means it (a BOS where the
    /// tokenizer's post-processor adds one).
    ///
    /// # Errors
    /// The tokenizer's own refusal.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        match &self.tok {
            Tok::Hf(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TextError::Tokenizer(e.to_string())),
            Tok::Spm(s) => Ok(s.encode(text, add_special_tokens)),
        }
    }

    /// Text of `ids`, special tokens skipped (ids the tokenizer does not know are dropped).
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.tok {
            Tok::Hf(t) => t.decode(ids, true).unwrap_or_default(),
            Tok::Spm(s) => s.decode(ids, true),
        }
    }

    /// One token as a log-probability entry names it: its text, special tokens included.
    #[must_use]
    pub fn token_text(&self, id: u32) -> String {
        match &self.tok {
            Tok::Hf(t) => t.decode(&[id], false).unwrap_or_default(),
            Tok::Spm(s) => s.decode(&[id], false),
        }
    }

    /// The end-of-sequence ids generation stops at (unless asked to ignore them).
    #[must_use]
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether ids 0..=255 are the bytes, as in the byte-level vocabulary `tl model init`
    /// writes (GPT-2's byte characters, one id per byte, in byte order).
    #[must_use]
    pub fn is_byte_level(&self) -> bool {
        let Tok::Hf(tok) = &self.tok else {
            return false;
        };
        let chars = byte_chars();
        (0..256u32)
            .all(|b| tok.id_to_token(b).as_deref() == Some(chars[b as usize].to_string().as_str()))
    }

    /// Whether the checkpoint has a chat template.
    #[must_use]
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The same text side with its templates run within `bounds`.
    #[must_use]
    pub fn with_bounds(mut self, bounds: RenderBounds) -> Self {
        self.template = self.template.map(|t| t.with_bounds(bounds));
        self
    }

    /// The chat template, if the checkpoint has one.
    #[must_use]
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// `messages` through the chat template ([`ChatTemplate::render`]).
    ///
    /// # Errors
    /// No template, one that fails on these messages, or one past a bound.
    pub fn render_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_chat_tools(messages, None, add_generation_prompt)
    }

    /// As [`render_chat`](Self::render_chat), with the request's `tools` in the template's
    /// `tools`.
    ///
    /// # Errors
    /// As [`render_chat`](Self::render_chat).
    pub fn render_chat_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.template
            .as_ref()
            .ok_or_else(|| TextError::Template("the checkpoint has no chat template".into()))?
            .render_tools(messages, tools, add_generation_prompt)
    }

    /// What each token id stands for as text: its bytes as the tokenizer's decoder writes them
    /// (a byte-level BPE token's bytes through GPT-2's byte map, a SentencePiece piece with `▁`
    /// as a space and `<0xNN>` as the byte NN) and whether it is special.
    #[must_use]
    pub fn vocab(&self) -> tl_engine_core::vocab::Vocab {
        let tok = match &self.tok {
            Tok::Hf(t) => t,
            Tok::Spm(s) => {
                return tl_engine_core::vocab::Vocab::new(
                    (0..s.len() as u32).map(|id| s.bytes_of(id).unwrap_or_default()),
                );
            }
        };
        let decoder = tok
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or(Value::Null);
        let kinds = decoder_kinds(&decoder);
        let byte_level = kinds.iter().any(|k| k == "ByteLevel");
        let metaspace = kinds
            .iter()
            .any(|k| k == "Metaspace" || k == "Replace" || k == "ByteFallback");
        let added = tok.get_added_tokens_decoder();
        let mut inverse = std::collections::HashMap::new();
        for (b, c) in byte_chars().iter().enumerate() {
            inverse.insert(*c, b as u8);
        }
        let n = tok.get_vocab_size(true) as u32;
        let n = n.max(added.keys().max().map_or(0, |m| m + 1));
        tl_engine_core::vocab::Vocab::new((0..n).map(|id| {
            if let Some(a) = added.get(&id) {
                return (a.content.clone().into_bytes(), a.special);
            }
            let Some(piece) = tok.id_to_token(id) else {
                return (Vec::new(), false);
            };
            let bytes = if byte_level {
                let mut out = Vec::with_capacity(piece.len());
                for c in piece.chars() {
                    match inverse.get(&c) {
                        Some(&b) => out.push(b),
                        None => {
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
                out
            } else if metaspace {
                match crate::spm::byte_piece(&piece) {
                    Some(b) => vec![b],
                    None => piece.replace('\u{2581}', " ").into_bytes(),
                }
            } else {
                tok.decode(&[id], false).unwrap_or_default().into_bytes()
            };
            (bytes, false)
        }))
    }

    /// An incremental decoder over this tokenizer.
    #[must_use]
    pub fn stream(&self) -> Detokenizer<'_> {
        Detokenizer {
            text: self,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// The environment a chat template renders in: Python's string methods (pycompat) and
/// `raise_exception`, which fails the render with the template's message.
fn chat_env_base() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env
}

/// The `type`s of a tokenizer decoder and of the decoders a `Sequence` holds.
fn decoder_kinds(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(t) = v.get("type").and_then(Value::as_str) {
        out.push(t.to_owned());
    }
    if let Some(list) = v.get("decoders").and_then(Value::as_array) {
        for d in list {
            out.extend(decoder_kinds(d));
        }
    }
    out
}

/// Text of a growing list of ids, piece by piece: each piece is what the newest ids add to the
/// decoding of a window that starts a few tokens back (so merged tokens, byte-level pieces and
/// byte-fallback tokens that only form a character together come out whole), held back while
/// the window's text ends in an incomplete character (U+FFFD). The pieces' concatenation is
/// the decoding of all the ids whenever the text is valid UTF-8.
#[derive(Debug)]
pub struct Detokenizer<'a> {
    text: &'a Text,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer<'_> {
    /// The text `ids` complete.
    pub fn push(&mut self, ids: &[u32]) -> String {
        self.ids.extend_from_slice(ids);
        let before = self.text.decode(&self.ids[self.prefix..self.read]);
        let now = self.text.decode(&self.ids[self.prefix..]);
        if now.len() > before.len()
            && !now.ends_with('\u{FFFD}')
            && now.is_char_boundary(before.len())
        {
            self.prefix = self.read;
            self.read = self.ids.len();
            now[before.len()..].to_owned()
        } else {
            String::new()
        }
    }

    /// What was held back, at the end of the stream.
    pub fn finish(&mut self) -> String {
        let before = self.text.decode(&self.ids[self.prefix..self.read]);
        let now = self.text.decode(&self.ids[self.prefix..]);
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        if now.len() > before.len() && now.is_char_boundary(before.len()) {
            now[before.len()..].to_owned()
        } else {
            String::new()
        }
    }
}

/// GPT-2's map from bytes to printable characters, which byte-level BPE vocabularies are
/// written in: printable Latin-1 bytes stand for themselves, the others for U+0100 onwards.
#[must_use]
pub fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('?');
            next += 1;
            c
        };
    }
    out
}

/// The byte-level tokenizer files of `tl model init`: ids 0..=255 are the bytes (so the model
/// reads the same ids as the engine's built-in byte tokenizer), then `specials` from 256 on
/// (`<|im_start|>` as BOS, `<|im_end|>` as EOS and end of turn, as SmolLM2 publishes them),
/// a ChatML chat template, and `eos` in `generation_config.json`. Returns
/// `(tokenizer.json, tokenizer_config.json, generation_config.json)`.
#[must_use]
pub fn byte_level_files(specials: &[&str], bos: u32, eos: u32) -> (String, String, String) {
    let chars = byte_chars();
    let vocab: serde_json::Map<String, Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), Value::from(i)))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({
                "id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            })
        })
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false,
    });
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [],
        },
    });
    let name = |id: u32| {
        specials
            .get(id.wrapping_sub(256) as usize)
            .copied()
            .unwrap_or("")
    };
    let template = "{% for message in messages %}{{ bos_token + message['role'] + '\\n' + \
                    message['content'] + eos_token + '\\n' }}{% endfor %}\
                    {% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}";
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos),
        "eos_token": name(eos),
        "add_bos_token": false,
        "model_max_length": 8192,
        "chat_template": template,
    });
    let generation = serde_json::json!({ "bos_token_id": bos, "eos_token_id": eos });
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default();
    (pretty(&tokenizer), pretty(&config), pretty(&generation))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECIALS: [&str; 4] = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"];

    fn byte_text(name: &str) -> Text {
        let dir = std::env::temp_dir().join(format!("tl-text-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (t, c, g) = byte_level_files(&SPECIALS, 256, 257);
        std::fs::write(dir.join("tokenizer.json"), t).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), c).unwrap();
        std::fs::write(dir.join("generation_config.json"), g).unwrap();
        let text = Text::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        text
    }

    /// The byte-level tokenizer.json read by the `tokenizers` crate gives the engine's own
    /// byte ids, and decodes them back, for ASCII, multi-byte text and control bytes.
    #[test]
    fn byte_level_tokenizer_is_the_byte_ids() {
        let text = byte_text("bytes");
        for s in [
            "hello world",
            "héllo wörld, Բարեւ, 日本語, 🦀!",
            "tab\tnew\nline\r\0end",
            "",
        ] {
            let ids = text.encode(s, true).unwrap();
            assert_eq!(ids, s.bytes().map(u32::from).collect::<Vec<_>>(), "{s:?}");
            assert_eq!(text.decode(&ids), s);
        }
        // Special tokens in text are their ids; decoding skips them; token_text names them.
        assert_eq!(text.encode("a<|im_end|>", true).unwrap(), vec![97, 257]);
        assert_eq!(text.decode(&[97, 257, 98]), "ab");
        assert_eq!(text.token_text(257), "<|im_end|>");
        assert_eq!(text.eos_ids(), &[257]);
        assert!(text.is_byte_level());
    }

    /// The chat template renders ChatML with the generation prompt, as transformers does.
    #[test]
    fn chat_template_renders_with_the_generation_prompt() {
        let text = byte_text("chat");
        let m = [
            Message {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            Message {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            text.render_chat(&m, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(
            !text
                .render_chat(&m, false)
                .unwrap()
                .ends_with("assistant\n")
        );
    }

    /// Streamed text equals the whole decoding for valid UTF-8 cut at every token, and a
    /// character split over byte tokens comes out whole with its last byte.
    #[test]
    fn streamed_text_equals_whole_text() {
        let text = byte_text("stream");
        let s = "héllo wörld, Բարեւ, 日本語, 🦀!";
        let mut ids = text.encode(s, false).unwrap();
        ids.insert(3, 257); // a special in between: skipped in both
        for piece in 1..=ids.len() {
            let mut d = text.stream();
            let mut out: String = ids.chunks(piece).map(|c| d.push(c)).collect();
            out.push_str(&d.finish());
            assert_eq!(out, text.decode(&ids), "pieces of {piece}");
        }
        let mut d = text.stream();
        assert_eq!(d.push(&[0xF0, 0x9F]), "");
        assert_eq!(d.push(&[0xA6]), "");
        assert_eq!(d.push(&[0x80]), "🦀");
        // An incomplete character at the end is flushed as the tokenizer decodes it.
        assert_eq!(d.push(&[0xE6]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }

    /// Files that cannot be used are refused naming the file.
    #[test]
    fn broken_text_files_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("tl-text-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = Text::load(&dir).unwrap_err().to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("not found"),
            "{e}"
        );
        std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
        let e = Text::load(&dir).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        let (t, _, _) = byte_level_files(&SPECIALS, 256, 257);
        std::fs::write(dir.join("tokenizer.json"), t).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "{% for %}").unwrap();
        let e = Text::load(&dir).unwrap_err().to_string();
        assert!(e.starts_with("chat template"), "{e}");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{{ raise_exception('no system role') }}",
        )
        .unwrap();
        let text = Text::load(&dir).unwrap();
        let e = text.render_chat(&[], true).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// EOS comes from generation_config.json, plus the template's end-of-turn token: a
    /// checkpoint whose generation config names only `</s>` still stops at `<|im_end|>`.
    #[test]
    fn the_templates_end_of_turn_ends_a_completion() {
        let dir = std::env::temp_dir().join(format!("tl-text-eot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // BOS <|im_start|> (256), EOS <|pad|> (258): the template ends turns with <|im_end|>.
        let (t, c, g) = byte_level_files(&SPECIALS, 256, 258);
        std::fs::write(dir.join("tokenizer.json"), t).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), c).unwrap();
        std::fs::write(dir.join("generation_config.json"), g).unwrap();
        let mut tc: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        tc["chat_template"] = Value::from(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
        );
        std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
        let text = Text::load(&dir).unwrap();
        assert_eq!(text.eos_ids(), &[258, 257]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
