//! Tool calls in generated text: one streaming parser per template family, each in its own file
//! with the format's markers, the grammar that makes a model write calls in it, and its tests.
//!
//! Text arrives in pieces, as for [`StopMatcher`](super::StopMatcher). A parser lets through what
//! is plain content as soon as no marker can start in it, holds back what might still become a
//! call, and hands out each call whole once its last character arrived: a streamed call is one
//! delta with its name and all of its arguments. Feeding a text in any split gives the same
//! content and calls (the tests check it). Text that looked like a call but is not one (JSON that
//! does not parse, a call cut off at the end) is given back as content.

pub mod hermes;
mod llama3;
mod mistral;

use serde_json::Value;

pub use hermes::HermesParser;
pub use llama3::Llama3Parser;
pub use mistral::MistralParser;

/// How a model family writes tool calls (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "lower")]
pub enum ToolCallFormat {
    /// Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
    Hermes,
    /// Llama 3.x: `{"name": ..., "parameters": {...}}` as the whole answer (optionally after
    /// `<|python_tag|>`), several separated by `;`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
}

impl ToolCallFormat {
    /// The format a chat template writes, from the markers in its source; `None` when it shows none.
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains(hermes::START) {
            Some(Self::Hermes)
        } else if template_source.contains(mistral::START) {
            Some(Self::Mistral)
        } else if template_source.contains(llama3::PYTHON_TAG) || template_source.contains("\"parameters\"") {
            Some(Self::Llama3)
        } else {
            None
        }
    }

    /// A fresh parser for one answer.
    pub fn parser(self) -> ToolCallParser {
        match self {
            Self::Hermes => ToolCallParser::Hermes(HermesParser::default()),
            Self::Llama3 => ToolCallParser::Llama3(Llama3Parser::default()),
            Self::Mistral => ToolCallParser::Mistral(MistralParser::default()),
        }
    }

    /// The key this format puts a call's arguments under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3 => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }

    /// A Lark grammar (llguidance's dialect) for one or more calls in this format (just one unless
    /// `is_parallel`), each call's JSON being `call`, a rule body such as `%json {...}`.
    pub fn lark(self, call: &str, is_parallel: bool) -> String {
        match self {
            Self::Hermes => hermes::lark(call, is_parallel),
            Self::Llama3 => llama3::lark(call, is_parallel),
            Self::Mistral => mistral::lark(call, is_parallel),
        }
    }
}

/// A call the model made: the function's name and its arguments as compact JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What a push let through: content text, then calls completed by it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

impl Parsed {
    fn content(text: impl Into<String>) -> Self {
        Self {
            content: text.into(),
            calls: Vec::new(),
        }
    }

    /// Adds what a later push let through.
    pub fn append(&mut self, other: Parsed) {
        self.content.push_str(&other.content);
        self.calls.extend(other.calls);
    }
}

/// One answer's tool-call parser, of the format the model writes.
pub enum ToolCallParser {
    Hermes(HermesParser),
    Llama3(Llama3Parser),
    Mistral(MistralParser),
}

impl ToolCallParser {
    /// Feeds the next piece of text; returns the content now safe to send and the calls it completed.
    pub fn push(&mut self, text: &str) -> Parsed {
        match self {
            Self::Hermes(parser) => parser.push(text),
            Self::Llama3(parser) => parser.push(text),
            Self::Mistral(parser) => parser.push(text),
        }
    }

    /// The end of the answer: whatever was held back, as content (an unfinished call is not a call).
    pub fn finish(&mut self) -> Parsed {
        match self {
            Self::Hermes(parser) => parser.finish(),
            Self::Llama3(parser) => parser.finish(),
            Self::Mistral(parser) => parser.finish(),
        }
    }
}

/// A call from its JSON object: `name`, and `arguments` or `parameters` (an object, or a string holding
/// one); `None` when it is not one.
fn parse_call(json: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(json).ok()?;
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => Value::Object(Default::default()),
        Some(Value::String(text)) => serde_json::from_str(text).ok()?,
        Some(arguments) => arguments.clone(),
    };
    arguments.is_object().then(|| ToolCall {
        name,
        arguments: arguments.to_string(),
    })
}

/// The byte length of the JSON object `text` starts with (`{` first), braces inside strings ignored;
/// `None` while it is not closed yet.
fn json_object_len(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, byte) in text.bytes().enumerate() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' => depth += 1,
            b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Feeds `text` to a fresh parser in pieces cut at `cuts` (byte offsets on char boundaries).
    pub fn parse_in_pieces(format: ToolCallFormat, text: &str, cuts: &[usize]) -> Parsed {
        let mut parser = format.parser();
        let mut parsed = Parsed::default();
        let mut start = 0;
        for &cut in cuts.iter().chain([&text.len()]) {
            parsed.append(parser.push(&text[start..cut]));
            start = cut;
        }
        parsed.append(parser.finish());
        parsed
    }

    /// `text` parsed whole equals `expected`, and so does every split of it into two and three
    /// pieces, and one character at a time.
    pub fn check(format: ToolCallFormat, text: &str, expected: &Parsed) {
        let boundaries: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        assert_eq!(&parse_in_pieces(format, text, &[]), expected, "{text:?} whole");
        assert_eq!(
            &parse_in_pieces(format, text, &boundaries),
            expected,
            "{text:?} char by char"
        );
        for (k, &i) in boundaries.iter().enumerate() {
            assert_eq!(&parse_in_pieces(format, text, &[i]), expected, "{text:?} cut at {i}");
            for &j in boundaries[k + 1..].iter().step_by(3) {
                assert_eq!(
                    &parse_in_pieces(format, text, &[i, j]),
                    expected,
                    "{text:?} cut at {i}, {j}"
                );
            }
        }
    }

    pub fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    pub fn parsed(content: &str, calls: Vec<ToolCall>) -> Parsed {
        Parsed {
            content: content.into(),
            calls,
        }
    }

    #[test]
    fn calls_parse_from_objects_and_strings() {
        assert_eq!(
            parse_call(r#"{"name": "f", "arguments": {"a": 1}}"#),
            Some(call("f", r#"{"a":1}"#))
        );
        assert_eq!(
            parse_call(r#"{"name": "f", "parameters": "{\"a\": [1]}"}"#),
            Some(call("f", r#"{"a":[1]}"#))
        );
        assert_eq!(parse_call(r#"{"name": "f"}"#), Some(call("f", "{}")));
        assert_eq!(parse_call(r#"{"arguments": {}}"#), None);
        assert_eq!(parse_call(r#"{"name": "f", "arguments": 3}"#), None);
    }

    #[test]
    fn json_objects_end_at_their_closing_brace() {
        let object = r#"{"a": "}{", "b": {"c": "\"}"}}"#;
        assert_eq!(json_object_len(&format!("{object} tail")), Some(object.len()));
        assert_eq!(json_object_len(r#"{"a": {"#), None);
    }

    #[test]
    fn formats_are_detected_from_templates() {
        assert_eq!(
            ToolCallFormat::detect("{{ '<tool_call>\\n' }}"),
            Some(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::detect("{{ '[TOOL_CALLS]' }}"),
            Some(ToolCallFormat::Mistral)
        );
        assert_eq!(
            ToolCallFormat::detect("{{- '<|python_tag|>' }}"),
            Some(ToolCallFormat::Llama3)
        );
        assert_eq!(ToolCallFormat::detect("{{ message.content }}"), None);
    }
}
