//! Structured outputs: a JSON schema, JSON mode, a regular expression, a list of choices or a
//! Lark grammar, compiled with `llguidance` over the model's own vocabulary into the core's
//! [`Constraint`].
//!
//! What moves between engines is a [`Spec`] (its kind and text, `SamplingParams.structured`).
//! Each engine compiles it; the core feeds the compiled grammar the sequence's output so far
//! (the first token on a decode engine, every token sent before a failover), so every engine
//! holds the state one engine would.
//!
//! Bounded: a spec is at most [`MAX_SPEC_BYTES`]; compiling and each step's mask run within
//! llguidance's fuel limits ([`limits`]); compiling runs off the async workers (the gateway's
//! per-key-fair prep, an engine's blocking pool).

use std::sync::{Arc, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use tl_engine_core::constraint::{Constraint, ConstraintError, Next};
use tl_engine_core::vocab::Vocab;

/// The longest spec taken, in bytes (a schema's JSON text, a regex, a grammar).
pub const MAX_SPEC_BYTES: usize = 64 * 1024;

/// What kind of text a [`Spec`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A JSON schema, as JSON text.
    JsonSchema,
    /// Any JSON object (OpenAI's JSON mode); the text is empty.
    JsonObject,
    /// A regular expression (Rust's `regex` syntax) the whole output matches.
    Regex,
    /// A grammar in llguidance's Lark syntax.
    Lark,
}

impl Kind {
    /// Its name on the wire.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Kind::JsonSchema => "json_schema",
            Kind::JsonObject => "json_object",
            Kind::Regex => "regex",
            Kind::Lark => "lark",
        }
    }

    /// The kind named `name` on the wire.
    #[must_use]
    pub fn named(name: &str) -> Option<Kind> {
        [Kind::JsonSchema, Kind::JsonObject, Kind::Regex, Kind::Lark]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// Its kind.
    pub kind: Kind,
    /// Its text.
    pub text: String,
}

impl Spec {
    /// A regular expression matching exactly one of `choices` (vLLM's `guided_choice`).
    ///
    /// # Errors
    /// No choice, or an empty one.
    pub fn choice(choices: &[String]) -> Result<Spec, StructuredError> {
        if choices.is_empty() || choices.iter().any(String::is_empty) {
            return Err(StructuredError::Refused(
                "choices are one or more non-empty strings".into(),
            ));
        }
        let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
        Ok(Spec {
            kind: Kind::Regex,
            text: format!("(?:{})", alternatives.join("|")),
        })
    }

    /// A regular expression the whole output matches.
    #[must_use]
    pub fn regex(text: &str) -> Spec {
        Spec {
            kind: Kind::Regex,
            text: text.to_owned(),
        }
    }

    /// A grammar in llguidance's Lark syntax.
    #[must_use]
    pub fn lark(text: &str) -> Spec {
        Spec {
            kind: Kind::Lark,
            text: text.to_owned(),
        }
    }

    /// A JSON schema given as a JSON value.
    #[must_use]
    pub fn json_schema(schema: &serde_json::Value) -> Spec {
        Spec {
            kind: Kind::JsonSchema,
            text: schema.to_string(),
        }
    }

    /// The grammar llguidance compiles, after the size bound. JSON is compact (no free
    /// whitespace between tokens): a small model given the choice pads with newlines until
    /// `max_tokens` and never closes the object.
    fn grammar(&self) -> Result<TopLevelGrammar, StructuredError> {
        if self.text.len() > MAX_SPEC_BYTES {
            return Err(StructuredError::TooLarge(self.text.len()));
        }
        let compact = |mut schema: serde_json::Value| {
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance")
                    .or_insert_with(|| serde_json::json!({ "whitespace_flexible": false }));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match self.kind {
            Kind::JsonSchema => {
                let schema: serde_json::Value = serde_json::from_str(&self.text)
                    .map_err(|e| StructuredError::Refused(format!("the schema: {e}")))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(StructuredError::Refused(
                        "the schema is a JSON object".into(),
                    ));
                }
                compact(schema)
            }
            Kind::JsonObject => compact(serde_json::json!({ "type": "object" })),
            Kind::Regex => TopLevelGrammar::from_regex(&self.text),
            Kind::Lark => TopLevelGrammar::from_lark(self.text.clone()),
        })
    }
}

/// Why a spec was refused (HTTP 400, INVALID_ARGUMENT).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StructuredError {
    /// Past [`MAX_SPEC_BYTES`].
    #[error("is {0} bytes; at most {MAX_SPEC_BYTES}")]
    TooLarge(usize),
    /// The library refused it (its message names the part).
    #[error("{0}")]
    Refused(String),
    /// A kind this server does not know (from a peer).
    #[error("unknown structured-output kind {0:?}")]
    Kind(String),
}

/// The bounds every grammar compiles and steps within: llguidance's defaults, tighter where a
/// request could make an engine thread work for long (the lexer's fuel to build the grammar and
/// for each step's mask, and the grammar's size).
#[must_use]
pub fn limits() -> ParserLimits {
    ParserLimits {
        initial_lexer_fuel: 500_000,
        step_lexer_fuel: 200_000,
        max_grammar_size: 100_000,
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// The compiler for one vocabulary: built once per model (it indexes every token's bytes).
pub struct Grammars {
    factory: ParserFactory,
    /// The trie's own end token, past the model's vocabulary: never sampled.
    end: u32,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("end", &self.end).finish()
    }
}

impl Grammars {
    /// The compiler for `vocab`: each token's bytes (a special token by its name, which no
    /// grammar's text matches).
    ///
    /// # Errors
    /// The library's refusal.
    pub fn new(vocab: &Vocab) -> Result<Grammars, StructuredError> {
        let mut words: Vec<Vec<u8>> = (0..vocab.len() as u32)
            .map(|t| {
                if vocab.is_special(t) {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], vocab.piece(t)].concat()
                } else {
                    vocab.piece(t).to_vec()
                }
            })
            .collect();
        let end = words.len() as u32;
        words.push(b"\xff<|tl_grammar_end|>".to_vec());
        let info = TokRxInfo::new(words.len() as u32, end);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| StructuredError::Refused(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Grammars { factory, end })
    }

    /// The compiler for the byte vocabulary (the fake model's, and the gateway's check of a
    /// spec when it has no tokenizer), shared.
    #[must_use]
    pub fn bytes() -> &'static Grammars {
        static BYTES: OnceLock<Grammars> = OnceLock::new();
        BYTES.get_or_init(|| Grammars::new(&Vocab::bytes()).expect("the byte vocabulary compiles"))
    }

    /// `spec` compiled, fresh (no token fed yet).
    ///
    /// # Errors
    /// A spec past its bounds, or one the library refuses.
    pub fn compile(&self, spec: &Spec) -> Result<Grammar, StructuredError> {
        let parser = self
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| StructuredError::Refused(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Refused(e));
        }
        Ok(Grammar {
            matcher,
            end: self.end,
        })
    }
}

/// A compiled spec and where the output stands in it.
pub struct Grammar {
    matcher: Matcher,
    end: u32,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").finish_non_exhaustive()
    }
}

impl Constraint for Grammar {
    fn next(&mut self) -> Result<Next, ConstraintError> {
        if self.matcher.is_stopped() {
            return match self.matcher.get_error() {
                Some(e) => Err(ConstraintError(e)),
                None => Ok(Next::End),
            };
        }
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| ConstraintError(e.to_string()))?;
        let may_end = mask.is_allowed(self.end);
        let mut bits = mask.as_slice().to_vec();
        // The trie's end token is not the model's: ending is `may_end`'s business.
        if let Some(w) = bits.get_mut(self.end as usize / 32) {
            *w &= !(1 << (self.end % 32));
        }
        if may_end && bits.iter().all(|&w| w == 0) {
            return Ok(Next::End);
        }
        Ok(Next::Allowed { bits, may_end })
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(e.to_string()))
    }

    fn fork(&self) -> Box<dyn Constraint> {
        Box::new(Grammar {
            matcher: self.matcher.deep_clone(),
            end: self.end,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds the byte tokens of `text` while the mask allows each; returns what was taken.
    fn walk(g: &mut Grammar, text: &str) -> (usize, Next) {
        let mut n = 0;
        for b in text.bytes() {
            let next = g.next().unwrap();
            if !next.allows(u32::from(b), &[]) {
                return (n, next);
            }
            g.commit(u32::from(b)).unwrap();
            n += 1;
        }
        (n, g.next().unwrap())
    }

    #[test]
    fn a_schema_allows_its_documents_and_refuses_others() {
        let spec = Spec::json_schema(&serde_json::json!({
            "type": "object",
            "properties": { "n": { "type": "integer" }, "ok": { "type": "boolean" } },
            "required": ["n", "ok"],
            "additionalProperties": false
        }));
        let g = Grammars::bytes();
        let mut m = g.compile(&spec).unwrap();
        let doc = r#"{"n":12,"ok":true}"#;
        let (n, next) = walk(&mut m, doc);
        assert_eq!(n, doc.len());
        assert_eq!(next, Next::End);
        // A string where the integer goes is refused at its first byte.
        let mut m = g.compile(&spec).unwrap();
        let (n, _) = walk(&mut m, r#"{"n":"x"#);
        assert_eq!(n, 5);
        // A fork goes on by itself.
        let mut a = g.compile(&spec).unwrap();
        walk(&mut a, r#"{"n":1"#);
        let mut b = a.fork();
        b.commit(u32::from(b'2')).unwrap();
        assert!(a.next().unwrap().allows(u32::from(b'3'), &[]));
    }

    #[test]
    fn choices_regexes_and_json_mode() {
        let g = Grammars::bytes();
        let spec = Spec::choice(&["yes".into(), "no (maybe)".into()]).unwrap();
        let mut m = g.compile(&spec).unwrap();
        assert_eq!(walk(&mut m, "no (maybe)"), (10, Next::End));
        let mut m = g.compile(&spec).unwrap();
        assert_eq!(walk(&mut m, "nope").0, 2);
        let mut m = g
            .compile(&Spec {
                kind: Kind::Regex,
                text: "[0-9]{3}".into(),
            })
            .unwrap();
        assert_eq!(walk(&mut m, "123"), (3, Next::End));
        let mut m = g
            .compile(&Spec {
                kind: Kind::JsonObject,
                text: String::new(),
            })
            .unwrap();
        assert_eq!(walk(&mut m, "[1]").0, 0);
        assert_eq!(walk(&mut m, r#"{"a":[1]}"#), (9, Next::End));
    }

    #[test]
    fn bad_specs_are_refused_with_the_librarys_reason() {
        let g = Grammars::bytes();
        let refused = |kind, text: &str| {
            g.compile(&Spec {
                kind,
                text: text.into(),
            })
            .unwrap_err()
        };
        assert!(matches!(
            refused(Kind::JsonSchema, "{"),
            StructuredError::Refused(_)
        ));
        assert!(matches!(
            refused(Kind::JsonSchema, "[1]"),
            StructuredError::Refused(_)
        ));
        assert!(matches!(
            refused(
                Kind::JsonSchema,
                r#"{"type":"integer","minimum":5,"maximum":1}"#
            ),
            StructuredError::Refused(_)
        ));
        assert!(matches!(
            refused(Kind::Regex, "(["),
            StructuredError::Refused(_)
        ));
        assert!(matches!(
            refused(Kind::Lark, "start: nope"),
            StructuredError::Refused(_)
        ));
        let big = "a".repeat(MAX_SPEC_BYTES + 1);
        assert_eq!(
            refused(Kind::Regex, &big),
            StructuredError::TooLarge(MAX_SPEC_BYTES + 1)
        );
        assert!(Spec::choice(&[]).is_err());
    }
}
