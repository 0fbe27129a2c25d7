//! The tokenizer: `tokenizer.json` rebuilt from `tokenizer.ggml.*` (byte-level BPE), or a
//! SentencePiece vocabulary built from its pieces, scores and types, with the chat template and
//! the end-of-sequence ids a file carries.

use super::*;
use crate::spm::Spm;

/// The tokenizer, template and EOS ids a GGUF file carries, as the pieces of a
/// [`crate::Text`]: `tokenizer.json` rebuilt from `tokenizer.ggml.*`, the chat template, the
/// BOS and EOS token strings, and the EOS ids (the file's, plus the template's end-of-turn
/// token).
///
/// # Errors
/// A tokenizer model other than `gpt2` (byte-level BPE) and `llama` (SentencePiece), an
/// unknown pre-tokenizer, or missing keys, named.
pub fn text_parts(g: &Gguf) -> Result<TextParts, CheckpointError> {
    let path = &g.path;
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Meta::as_str)
        .ok_or_else(|| bad(path, "tokenizer.ggml.model: missing"))?;
    let Some(Meta::Array(tokens)) = g.get("tokenizer.ggml.tokens") else {
        return Err(bad(path, "tokenizer.ggml.tokens: missing"));
    };
    let tokens: Vec<&str> = tokens.iter().map(|t| t.as_str().unwrap_or("")).collect();
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(Meta::Array(a)) => a.iter().map(|t| t.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let tokenizer = match model {
        "gpt2" => Tokenizer::Json(byte_level_json(g, &tokens, &types)?),
        "llama" => Tokenizer::Spm(Box::new(sentencepiece(g, &tokens, &types)?)),
        other => {
            return Err(bad(
                path,
                format!(
                    "tokenizer.ggml.model = {other:?}: served: \"gpt2\" (byte-level BPE), \
                     \"llama\" (SentencePiece)"
                ),
            ));
        }
    };
    let id_of = |key: &str| g.get(key).and_then(Meta::as_u64).map(|v| v as u32);
    let name = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| (*s).to_owned())
    };
    let bos_id = id_of("tokenizer.ggml.bos_token_id");
    let template = g
        .get("tokenizer.chat_template")
        .and_then(Meta::as_str)
        .map(str::to_owned);
    let eos_id = id_of("tokenizer.ggml.eos_token_id");
    let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
    // The template's end of turn ends a completion too.
    if let Some(t) = &template {
        let controls = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| **ty == 3)
            .map(|(id, (tok, _))| (id as u32, (*tok).to_owned()));
        for id in crate::turns::end_of_turn(t, controls) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    Ok(TextParts {
        tokenizer,
        template,
        bos: name(bos_id),
        eos: name(eos_id),
        eos_ids,
    })
}

/// Whether a boolean key is true, or `default` where the file does not say.
fn flag(g: &Gguf, key: &str, default: bool) -> bool {
    match g.get(key) {
        Some(Meta::Bool(b)) => *b,
        _ => default,
    }
}

/// The SentencePiece vocabulary of a `llama` tokenizer: its pieces, scores and types, a BOS
/// when `add_bos_token` (llama.cpp's default for it: yes), a `▁` prefix when
/// `add_space_prefix` (default: yes).
fn sentencepiece(g: &Gguf, tokens: &[&str], types: &[u64]) -> Result<Spm, CheckpointError> {
    let scores: Vec<f32> = match g.get("tokenizer.ggml.scores") {
        Some(Meta::Array(a)) => a.iter().map(|s| s.as_f64().unwrap_or(0.0) as f32).collect(),
        _ => return Err(bad(&g.path, "tokenizer.ggml.scores: missing")),
    };
    let bos = g
        .get("tokenizer.ggml.bos_token_id")
        .and_then(Meta::as_u64)
        .map(|v| v as u32)
        .filter(|_| flag(g, "tokenizer.ggml.add_bos_token", true));
    Spm::new(
        tokens.iter().map(|t| (*t).to_owned()).collect(),
        scores,
        types
            .iter()
            .map(|t| u8::try_from(*t).unwrap_or(0))
            .collect(),
        bos,
        flag(g, "tokenizer.ggml.add_space_prefix", true),
    )
    .map_err(|e| bad(&g.path, format!("the SentencePiece vocabulary: {e}")))
}

/// `tokenizer.json` for a byte-level BPE tokenizer (`gpt2`), rebuilt from its vocabulary,
/// merges and pre-tokenizer.
fn byte_level_json(g: &Gguf, tokens: &[&str], types: &[u64]) -> Result<String, CheckpointError> {
    let path = &g.path;
    let merges: Vec<&str> = match g.get("tokenizer.ggml.merges") {
        Some(Meta::Array(a)) => a.iter().filter_map(Meta::as_str).collect(),
        _ => return Err(bad(path, "tokenizer.ggml.merges: missing")),
    };
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Meta::as_str)
        .unwrap_or("default");
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let pre_tokenizer = match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        other => {
            return Err(bad(
                path,
                format!(
                    "tokenizer.ggml.pre = {other:?}: served: default, gpt-2, smollm, qwen2, \
                     llama-bpe"
                ),
            ));
        }
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
        vocab.insert(t.to_owned(), json!(id));
        // 3: control (special), 4: user-defined (added, not special).
        if ty == 3 || ty == 4 {
            added.push(
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3}),
            );
        }
    }
    let id_of = |key: &str| g.get(key).and_then(Meta::as_u64).map(|v| v as u32);
    let name = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| (*s).to_owned())
    };
    let bos_id = id_of("tokenizer.ggml.bos_token_id");
    let add_bos = matches!(
        g.get("tokenizer.ggml.add_bos_token"),
        Some(Meta::Bool(true))
    );
    let post = match (add_bos, name(bos_id)) {
        (true, Some(bos)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.clone(): {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }),
        _ => byte_level(false),
    };
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    Ok(tokenizer.to_string())
}

/// A tokenizer as a GGUF file gives it.
#[derive(Debug)]
pub enum Tokenizer {
    /// A `tokenizer.json` (byte-level BPE).
    Json(String),
    /// A SentencePiece vocabulary.
    Spm(Box<Spm>),
}

/// What [`text_parts`] gives.
#[derive(Debug)]
pub struct TextParts {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: Option<String>,
    /// The BOS token's text.
    pub bos: Option<String>,
    /// The EOS token's text.
    pub eos: Option<String>,
    /// Ids that end a sequence.
    pub eos_ids: Vec<u32>,
}
