//! OpenAI's tool calls. With `tool_choice` a named function or `required`, a grammar enforces
//! them: the output is constrained to JSON (a named function's arguments, or a list of
//! `{"name", "parameters"}` calls, vLLM's shape), so it always parses. With `auto` (OpenAI's
//! default when `tools` are given) the model decides: calls written in the Hermes format
//! (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which Qwen2.5 and Hermes
//! checkpoints write and vLLM's `hermes` parser reads) are read out of the text. Either way the
//! answer carries them as `message.tool_calls` with `finish_reason: "tool_calls"`. `none` (or
//! no `tools`) is plain text.

use serde::{Deserialize, Serialize};

use super::ApiError;
use crate::structured::Spec;

/// The most tools a request may list.
pub const MAX_TOOLS: usize = 128;

/// One of OpenAI's `tools`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

/// A function a tool names.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    /// 1 to 64 of `a-z A-Z 0-9 _ -`.
    pub name: String,
    /// What it does (not used).
    #[serde(default)]
    pub description: Option<String>,
    /// Its arguments' JSON schema (absent: any object).
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
    /// OpenAI's strict mode: the schema is always enforced here.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// OpenAI's `tool_choice`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(
    untagged,
    expecting = "\"none\", \"auto\", \"required\" or a named function"
)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(ChoiceMode),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named {
        /// Always `function`.
        #[serde(rename = "type")]
        kind: String,
        /// The function's name.
        function: NamedFunction,
    },
}

/// The named modes of `tool_choice`.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ChoiceMode {
    /// No call: the tools are not offered.
    None,
    /// The model chooses between words and calls.
    Auto,
    /// At least one call.
    Required,
}

/// The function a named `tool_choice` forces.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// How the answer is read back into calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// The output is this function's arguments.
    Named(String),
    /// The output is a list of `{"name", "parameters"}`.
    Required,
    /// The output is text, with calls in Hermes' `<tool_call>` blocks if the model wrote any.
    Auto,
}

/// One call as OpenAI answers it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ToolCall {
    /// Its index in the list (streamed answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// `call_...`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: CalledFunction,
}

/// A call's function.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct CalledFunction {
    /// Its name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// What `tools`, `tool_choice` and `parallel_tool_calls` ask for: nothing (no tools, or
/// `none`), or the mode and the grammar that enforces it (none for `auto`).
///
/// # Errors
/// 400 naming the field: a malformed tool, a choice naming no listed tool, or `required` or
/// `auto` without tools.
pub fn tool_mode(
    tools: Option<&[Tool]>,
    choice: Option<&ToolChoice>,
    parallel: Option<bool>,
) -> Result<Option<(ToolMode, Option<Spec>)>, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::bad_field(
            "tools",
            format!("has {} tools; at most {MAX_TOOLS}", tools.len()),
        ));
    }
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::bad_field(
                format!("tools[{i}].type"),
                "is `function`, the only kind of tool",
            ));
        }
        if !valid_name(&t.function.name) {
            return Err(ApiError::bad_field(
                format!("tools[{i}].function.name"),
                "is 1 to 64 of a-z, A-Z, 0-9, _ and -",
            ));
        }
        if t.function
            .parameters
            .as_ref()
            .is_some_and(|p| !p.is_object())
        {
            return Err(ApiError::bad_field(
                format!("tools[{i}].function.parameters"),
                "is a JSON schema object",
            ));
        }
    }
    let params = |t: &Tool| {
        t.function
            .parameters
            .clone()
            .unwrap_or_else(|| serde_json::json!({ "type": "object" }))
    };
    let mode = match choice {
        None if tools.is_empty() => return Ok(None),
        // OpenAI's default with tools.
        None => ChoiceMode::Auto,
        Some(ToolChoice::Mode(m)) => *m,
        Some(ToolChoice::Named { kind, function }) => {
            if kind != "function" {
                return Err(ApiError::bad_field("tool_choice.type", "is `function`"));
            }
            let Some(t) = tools.iter().find(|t| t.function.name == function.name) else {
                return Err(ApiError::bad_field(
                    "tool_choice.function.name",
                    format!("names {:?}, which `tools` does not list", function.name),
                ));
            };
            let spec = Spec::json_schema(&params(t));
            return Ok(Some((ToolMode::Named(function.name.clone()), Some(spec))));
        }
    };
    match mode {
        ChoiceMode::None => Ok(None),
        ChoiceMode::Required if tools.is_empty() => Err(ApiError::bad_field(
            "tool_choice",
            "is `required` but `tools` lists none",
        )),
        ChoiceMode::Required => {
            let calls: Vec<serde_json::Value> = tools
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "type": "object",
                        "properties": {
                            "name": { "const": t.function.name },
                            "parameters": params(t),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut list = serde_json::json!({
                "type": "array",
                "minItems": 1,
                "items": { "anyOf": calls },
            });
            if parallel == Some(false) {
                list["maxItems"] = serde_json::json!(1);
            }
            Ok(Some((ToolMode::Required, Some(Spec::json_schema(&list)))))
        }
        ChoiceMode::Auto if tools.is_empty() => Err(ApiError::bad_field(
            "tool_choice",
            "is `auto` but `tools` lists none",
        )),
        ChoiceMode::Auto => Ok(Some((ToolMode::Auto, None))),
    }
}

/// The calls in an answer's text, as `mode` constrained it, and the text beside them (`auto`'s
/// words around its blocks, none if only blanks); `None` when the text holds no calls (cut
/// short by `max_tokens`, or an `auto` answer in words).
#[must_use]
pub fn calls(
    mode: &ToolMode,
    text: &str,
    request_id: &str,
    choice: u32,
) -> Option<(Option<String>, Vec<ToolCall>)> {
    let id = |i: usize| {
        format!(
            "call_{}_{choice}_{i}",
            request_id.trim_start_matches("cmpl-")
        )
    };
    let call = |i: usize, name: String, arguments: String| ToolCall {
        index: None,
        id: id(i),
        kind: "function".into(),
        function: CalledFunction { name, arguments },
    };
    if *mode == ToolMode::Auto {
        let (words, blocks) = hermes_blocks(text)?;
        let calls = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let v: serde_json::Value = serde_json::from_str(b.trim()).ok()?;
                let args = match v.get("arguments")? {
                    serde_json::Value::String(s) => s.clone(),
                    a => a.to_string(),
                };
                Some(call(i, v["name"].as_str()?.to_owned(), args))
            })
            .collect::<Option<Vec<_>>>()?;
        let words = words.trim();
        return Some(((!words.is_empty()).then(|| words.to_owned()), calls));
    }
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let calls = match mode {
        ToolMode::Named(name) => v
            .is_object()
            .then(|| vec![call(0, name.clone(), text.to_owned())]),
        _ => v
            .as_array()?
            .iter()
            .enumerate()
            .map(|(i, c)| {
                Some(call(
                    i,
                    c["name"].as_str()?.to_owned(),
                    c.get("parameters")?.to_string(),
                ))
            })
            .collect(),
    }?;
    Some((None, calls))
}

/// The text outside Hermes' `<tool_call>...</tool_call>` blocks and each block's inside;
/// `None` without a block, or with one left open.
fn hermes_blocks(text: &str) -> Option<(String, Vec<&str>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut words = String::new();
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        words.push_str(&rest[..at]);
        let inside = &rest[at + OPEN.len()..];
        let end = inside.find(CLOSE)?;
        blocks.push(&inside[..end]);
        rest = &inside[end + CLOSE.len()..];
    }
    words.push_str(rest);
    (!blocks.is_empty()).then_some((words, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool {
            kind: "function".into(),
            function: FunctionDef {
                name: name.into(),
                description: None,
                parameters: Some(serde_json::json!({
                    "type": "object",
                    "properties": { "city": { "type": "string" } },
                    "required": ["city"]
                })),
                strict: None,
            },
        }
    }

    #[test]
    fn modes_and_refusals() {
        let tools = [tool("get_weather"), tool("get_time")];
        assert_eq!(tool_mode(None, None, None).unwrap(), None);
        let none = ToolChoice::Mode(ChoiceMode::None);
        assert_eq!(tool_mode(Some(&tools), Some(&none), None).unwrap(), None);
        let named = ToolChoice::Named {
            kind: "function".into(),
            function: NamedFunction {
                name: "get_time".into(),
            },
        };
        let (m, _) = tool_mode(Some(&tools), Some(&named), None)
            .unwrap()
            .unwrap();
        assert_eq!(m, ToolMode::Named("get_time".into()));
        let req = ToolChoice::Mode(ChoiceMode::Required);
        let (m, spec) = tool_mode(Some(&tools), Some(&req), Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(m, ToolMode::Required);
        let spec = spec.unwrap();
        assert!(spec.text.contains("\"maxItems\":1"), "{}", spec.text);
        // `auto`, OpenAI's default with tools: no grammar.
        assert_eq!(
            tool_mode(Some(&tools), None, None).unwrap(),
            Some((ToolMode::Auto, None))
        );
        let refused =
            |t: Option<&[Tool]>, c: Option<&ToolChoice>| tool_mode(t, c, None).unwrap_err().param;
        let auto = ToolChoice::Mode(ChoiceMode::Auto);
        assert_eq!(refused(None, Some(&auto)).as_deref(), Some("tool_choice"));
        assert_eq!(refused(None, Some(&req)).as_deref(), Some("tool_choice"));
        let other = ToolChoice::Named {
            kind: "function".into(),
            function: NamedFunction {
                name: "nope".into(),
            },
        };
        assert_eq!(
            refused(Some(&tools), Some(&other)).as_deref(),
            Some("tool_choice.function.name")
        );
        let bad = [tool("has space")];
        assert_eq!(
            refused(Some(&bad), Some(&req)).as_deref(),
            Some("tools[0].function.name")
        );
    }

    #[test]
    fn calls_are_read_from_the_constrained_text() {
        let named = ToolMode::Named("get_weather".into());
        let c = calls(&named, r#"{"city":"Paris"}"#, "cmpl-7", 0).unwrap().1;
        assert_eq!(c[0].function.name, "get_weather");
        assert_eq!(c[0].function.arguments, r#"{"city":"Paris"}"#);
        let text = r#"[{"name":"get_time","parameters":{"city":"Rome"}},{"name":"get_weather","parameters":{"city":"Oslo"}}]"#;
        let c = calls(&ToolMode::Required, text, "cmpl-7", 1).unwrap().1;
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].function.name, "get_weather");
        assert_eq!(c[1].function.arguments, r#"{"city":"Oslo"}"#);
        assert_ne!(c[0].id, c[1].id);
        // Cut short: no calls.
        assert_eq!(calls(&named, r#"{"city":"Pa"#, "cmpl-7", 0), None);
        // Hermes blocks, with words around them; words alone, or a block left open, are text.
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (words, c) = calls(&ToolMode::Auto, text, "cmpl-7", 0).unwrap();
        assert_eq!(words.as_deref(), Some("Let me look."));
        assert_eq!(c[0].function.name, "get_weather");
        assert_eq!(c[0].function.arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls(&ToolMode::Auto, "It is sunny.", "cmpl-7", 0), None);
        assert_eq!(
            calls(&ToolMode::Auto, "<tool_call>{\"name\":", "cmpl-7", 0),
            None
        );
    }
}
