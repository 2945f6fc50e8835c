//! Tool calls in generated text: one streaming parser per template family, each in its own file
//! with the format's markers, the grammar that makes a model write calls in it, and its tests.
//!
//! Text arrives in pieces, as for [`StopMatcher`](super::StopMatcher). A parser lets through what
//! is plain content as soon as no marker can start in it, holds back what might still become a
//! call, and streams each call as it is written: a [`CallDelta`] with its name once the name is
//! known, then deltas appending to its arguments (compact JSON), and the [`ToolCall`] whole once its
//! last character arrived. Feeding a text in any split gives the same content and calls, and deltas
//! that add up to the calls (the tests check it). Text that looked like a call but is not one (JSON
//! that does not parse, a call cut off at the end) is given back as content, though deltas of it may
//! have been streamed already; under a grammar (`tool_choice` of any kind but `none`) every call the
//! model starts is a valid one, so this happens only to a call cut off by `max_tokens`.

pub mod hermes;
mod llama3;
mod mistral;
mod mistral_args;
mod qwen3_coder;

use serde_json::Value;

use super::escape_regex;

pub use hermes::HermesParser;
pub use llama3::Llama3Parser;
pub use mistral::MistralParser;
pub use mistral_args::MistralArgsParser;
pub use qwen3_coder::Qwen3CoderParser;

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
    /// Newer Mistral tokenizers (v11 on: Mistral Small 3.2, Magistral, Devstral):
    /// `[TOOL_CALLS]name[ARGS]{...}`, once per call.
    #[value(name = "mistral_args")]
    MistralArgs,
    /// Qwen3-Coder: `<tool_call>\n<function=name>\n<parameter=arg>\nvalue\n</parameter>\n</function>\n</tool_call>`,
    /// values typed by the tool's schema.
    #[value(name = "qwen3_coder")]
    Qwen3Coder,
}

/// A function the model may call: what parsers and grammars need of a tool.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    /// The JSON Schema of its arguments (an object schema).
    pub parameters: Value,
}

/// A format's grammar of calls, in parts: the format's trigger then `after` is one or more calls,
/// and `rules` defines the rules `after` uses.
struct CallsGrammar {
    after: String,
    rules: String,
    /// A regex of answers the parser reads as calls without the trigger; free text may not match it.
    untriggered: Option<&'static str>,
}

impl ToolCallFormat {
    /// The format a chat template writes, from the markers in its source; `None` when it shows none.
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains(qwen3_coder::FUNCTION) {
            Some(Self::Qwen3Coder)
        } else if template_source.contains(hermes::START) {
            Some(Self::Hermes)
        } else if template_source.contains(mistral_args::ARGS) {
            Some(Self::MistralArgs)
        } else if template_source.contains(mistral::START) {
            Some(Self::Mistral)
        } else if template_source.contains(llama3::PYTHON_TAG) || template_source.contains("\"parameters\"") {
            Some(Self::Llama3)
        } else {
            None
        }
    }

    /// The text that starts an answer's calls (empty: they start with the answer, as Llama 3's do).
    pub fn trigger(self) -> &'static str {
        match self {
            Self::Hermes | Self::Qwen3Coder => hermes::START,
            Self::Llama3 => "",
            Self::Mistral | Self::MistralArgs => mistral::START,
        }
    }

    /// The markers a call is written with. Where the tokenizer has them as special tokens, they must
    /// stay in the text of an answer that may call tools, for the parser to find the calls.
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            Self::Hermes => &[hermes::START, hermes::END],
            Self::Qwen3Coder => &[qwen3_coder::START, qwen3_coder::END],
            Self::Llama3 => &[llama3::PYTHON_TAG],
            Self::Mistral => &[mistral::START],
            Self::MistralArgs => &[mistral_args::START, mistral_args::ARGS],
        }
    }

    /// A fresh parser for one answer calling `functions` (whose schemas type Qwen3-Coder's values).
    pub fn parser(self, functions: &[Function]) -> ToolCallParser {
        match self {
            Self::Hermes => ToolCallParser::Hermes(HermesParser::default()),
            Self::Llama3 => ToolCallParser::Llama3(Llama3Parser::default()),
            Self::Mistral => ToolCallParser::Mistral(MistralParser::default()),
            Self::MistralArgs => ToolCallParser::MistralArgs(MistralArgsParser::default()),
            Self::Qwen3Coder => ToolCallParser::Qwen3Coder(Qwen3CoderParser::new(functions)),
        }
    }

    /// A Lark grammar (llguidance's dialect) of calls in this format to `functions` whose arguments
    /// follow their schemas: one call unless `is_parallel`. With `is_triggered`, free text (without
    /// the format's trigger) comes first and the calls are optional: the model may answer without
    /// calling, but once it writes the trigger, calls must follow and nothing after them.
    pub fn lark(self, functions: &[Function], is_parallel: bool, is_triggered: bool, markers: &Markers) -> String {
        let grammar = match self {
            Self::Hermes => hermes::grammar(functions, is_parallel, markers),
            Self::Llama3 => llama3::grammar(functions, is_parallel),
            Self::Mistral => mistral::grammar(functions, is_parallel),
            Self::MistralArgs => mistral_args::grammar(functions, is_parallel, markers),
            Self::Qwen3Coder => qwen3_coder::grammar(functions, is_parallel, markers),
        };
        let CallsGrammar {
            after,
            rules,
            untriggered,
        } = grammar;
        let trigger = self.trigger();
        let trigger_atom = if trigger.is_empty() {
            String::new()
        } else {
            markers.lark(trigger)
        };
        if !is_triggered {
            return format!("start: {trigger_atom} {after}\n{rules}");
        }
        let trigger_regex = escape_regex(trigger).replace('/', "\\/");
        // FREE: any text without the trigger's text (nor what reads as calls without it).
        let mut free = String::from("/(.|\\n)*/");
        if !trigger.is_empty() {
            free.push_str(&format!(" & ~/(.|\\n)*{trigger_regex}(.|\\n)*/"));
        }
        if let Some(untriggered) = untriggered {
            free.push_str(&format!(" & ~/{untriggered}/"));
        }
        let start = if trigger.is_empty() {
            format!("start: FREE | {after}\n")
        } else if markers.is_special(trigger) {
            // Text never holds a special token: the calls start at the trigger's token.
            format!("start: FREE | FREE? {trigger_atom} {after}\n")
        } else {
            // prefix: the text up to and with the first trigger (lazy: it ends there).
            format!("start: FREE | prefix {after}\nprefix[lazy]: /(.|\\n)*{trigger_regex}/\n")
        };
        format!("{start}FREE: {free}\n{rules}")
    }
}

/// How a grammar writes a format's markers: as the tokenizer's special token where it has one (a
/// model writes such a marker as that one token, which llguidance's text literal would not match:
/// it counts every added `<...>` token, Qwen's `<tool_call>` among them, as special), else as text.
pub struct Markers<'a>(pub &'a dyn Fn(&str) -> Option<u32>);

impl Markers<'_> {
    fn is_special(&self, marker: &str) -> bool {
        (self.0)(marker).is_some()
    }

    /// The marker as a Lark atom: `<[id]>` or a string literal.
    fn lark(&self, marker: &str) -> String {
        match (self.0)(marker) {
            Some(id) => format!("<[{id}]>"),
            None => lark_string(marker),
        }
    }
}

/// `text` as a Lark string literal (empty text: nothing).
fn lark_string(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        Value::from(text).to_string()
    }
}

/// A Lark rule body of JSON text matching `schema`, spaced as templates write it (Jinja's `tojson`,
/// Python's `json.dumps`): `", "` between items, `": "` after keys, and no other whitespace, so a
/// sampled call cannot spend its tokens on blanks (JSON's grammar allows any run of them).
fn json_rule(schema: &Value) -> String {
    let spacing = serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let mut schema = schema.clone();
    match schema.as_object_mut() {
        Some(object) => {
            object.insert("x-guidance".into(), spacing);
        }
        // `true`/`false` schemas: wrapped, as they hold no `$ref` to a root that would move.
        None => schema = serde_json::json!({"allOf": [schema], "x-guidance": spacing}),
    }
    format!("%json {schema}")
}

/// `schema` as the part at `pointer` of a larger schema: its references into itself (`#/...`, as to
/// its `$defs`) rewritten to point there. Values given as data (`const`, `enum`, ...) are left alone.
fn relocated(schema: &Value, pointer: &str) -> Value {
    match schema {
        Value::Object(object) => object
            .iter()
            .map(|(key, value)| {
                let value = match (key.as_str(), value) {
                    ("$ref", Value::String(reference)) if reference.starts_with('#') => {
                        Value::String(format!("#{pointer}{}", &reference[1..]))
                    }
                    ("const" | "enum" | "default" | "examples", _) => value.clone(),
                    _ => relocated(value, pointer),
                };
                (key.clone(), value)
            })
            .collect(),
        Value::Array(items) => items.iter().map(|item| relocated(item, pointer)).collect(),
        _ => schema.clone(),
    }
}

/// The rule body of one call's JSON object `{"name": ..., key: arguments}` to any of `functions`.
fn json_call_rule(functions: &[Function], arguments_key: &str) -> String {
    let calls: Vec<Value> = functions
        .iter()
        .enumerate()
        .map(|(i, function)| {
            let arguments = relocated(&function.parameters, &format!("/anyOf/{i}/properties/{arguments_key}"));
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": function.name}, arguments_key: arguments},
                "required": ["name", arguments_key],
                "additionalProperties": false,
            })
        })
        .collect();
    json_rule(&serde_json::json!({"anyOf": calls}))
}

/// A call the model made: the function's name and its arguments as compact JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A piece of a call as it is written: the first of a call carries its name; the concatenation of a
/// call's `arguments` is its [`ToolCall::arguments`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallDelta {
    /// Position of the call among the answer's calls.
    pub index: u32,
    pub name: Option<String>,
    pub arguments: String,
}

/// What a push let through: content text, the calls' deltas, and the calls completed by it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub deltas: Vec<CallDelta>,
    pub calls: Vec<ToolCall>,
}

impl Parsed {
    fn content(text: impl Into<String>) -> Self {
        Self {
            content: text.into(),
            ..Self::default()
        }
    }

    /// Free text of an answer: content, unless it is blank and the answer has made calls (the
    /// whitespace a template puts around calls is not an answer).
    fn push_free_text(&mut self, text: &str, has_calls: bool) {
        if !(has_calls && text.trim().is_empty()) {
            self.content.push_str(text);
        }
    }

    /// Adds what a later push let through.
    pub fn append(&mut self, other: Parsed) {
        self.content.push_str(&other.content);
        self.deltas.extend(other.deltas);
        self.calls.extend(other.calls);
    }
}

/// One answer's tool-call parser, of the format the model writes.
pub enum ToolCallParser {
    Hermes(HermesParser),
    Llama3(Llama3Parser),
    Mistral(MistralParser),
    MistralArgs(MistralArgsParser),
    Qwen3Coder(Qwen3CoderParser),
}

impl ToolCallParser {
    /// Feeds the next piece of text; returns the content now safe to send, the deltas of the calls
    /// being written, and the calls it completed.
    pub fn push(&mut self, text: &str) -> Parsed {
        match self {
            Self::Hermes(parser) => parser.push(text),
            Self::Llama3(parser) => parser.push(text),
            Self::Mistral(parser) => parser.push(text),
            Self::MistralArgs(parser) => parser.push(text),
            Self::Qwen3Coder(parser) => parser.push(text),
        }
    }

    /// The end of the answer: whatever was held back, as content (an unfinished call is not a call).
    pub fn finish(&mut self) -> Parsed {
        match self {
            Self::Hermes(parser) => parser.finish(),
            Self::Llama3(parser) => parser.finish(),
            Self::Mistral(parser) => parser.finish(),
            Self::MistralArgs(parser) => parser.finish(),
            Self::Qwen3Coder(parser) => parser.finish(),
        }
    }
}

/// Streams an answer's calls: numbers them and sends of each call's arguments what was not sent yet.
#[derive(Debug, Default)]
struct CallStream {
    /// Calls completed so far (the index of the open one).
    num_calls: u32,
    /// Of the open call: whether its name was sent, and how many bytes of its arguments.
    is_name_sent: bool,
    num_sent: usize,
}

impl CallStream {
    /// The open call named `name` has arguments starting with `arguments` (JSON, compacted here).
    fn progress(&mut self, name: &str, arguments: &str, parsed: &mut Parsed) {
        let arguments = compact_json(arguments);
        let new = arguments.get(self.num_sent..).unwrap_or_default();
        if self.is_name_sent && new.is_empty() {
            return;
        }
        parsed.deltas.push(CallDelta {
            index: self.num_calls,
            name: (!self.is_name_sent).then(|| name.to_owned()),
            arguments: new.to_owned(),
        });
        self.is_name_sent = true;
        self.num_sent = arguments.len();
    }

    /// The open call is complete: its last delta, and the call.
    fn complete(&mut self, call: ToolCall, parsed: &mut Parsed) {
        self.progress(&call.name, &call.arguments, parsed);
        parsed.calls.push(call);
        self.num_calls += 1;
        self.is_name_sent = false;
        self.num_sent = 0;
    }

    /// The JSON call object starting `text` (complete or not): its name once known, and its
    /// arguments so far.
    fn progress_json(&mut self, text: &str, parsed: &mut Parsed) {
        if let Some((name, arguments)) = json_call_head(text) {
            let len = json_object_len(arguments).unwrap_or(arguments.len());
            self.progress(&name, &arguments[..len], parsed);
        }
    }

    /// The complete JSON call object `json`: the call, or `None` (then nothing is sent).
    fn complete_json(&mut self, json: &str, parsed: &mut Parsed) -> Option<()> {
        let call = parse_call(json)?;
        self.complete(call, parsed);
        Some(())
    }
}

/// Of a JSON call object being written, `{"name": "...", "arguments": {...`: the name and the
/// text from the arguments' `{` on; `None` until the arguments start (or when the object is laid out
/// otherwise: such a call is sent whole at its end).
fn json_call_head(text: &str) -> Option<(String, &str)> {
    let rest = text.trim_start().strip_prefix('{')?.trim_start();
    let rest = rest
        .strip_prefix("\"name\"")?
        .trim_start()
        .strip_prefix(':')?
        .trim_start();
    let len = json_string_len(rest)?;
    let name: String = serde_json::from_str(&rest[..len]).ok()?;
    let rest = rest[len..].trim_start().strip_prefix(',')?.trim_start();
    let rest = rest
        .strip_prefix("\"arguments\"")
        .or_else(|| rest.strip_prefix("\"parameters\""))?
        .trim_start()
        .strip_prefix(':')?
        .trim_start();
    rest.starts_with('{').then_some((name, rest))
}

/// The byte length of the JSON string `text` starts with (`"` first); `None` while it is not closed.
fn json_string_len(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, byte) in text.bytes().enumerate().skip(1) {
        match byte {
            _ if escaped => escaped = false,
            b'\\' => escaped = true,
            b'"' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// JSON text without the whitespace between tokens; a prefix of a text compacts to a prefix of
/// the text's compact form, so arguments can be streamed as they are written.
fn compact_json(text: &str) -> String {
    let (mut compact, mut in_string, mut escaped) = (String::with_capacity(text.len()), false, false);
    for ch in text.chars() {
        if in_string {
            match ch {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else if ch.is_ascii_whitespace() {
            continue;
        } else if ch == '"' {
            in_string = true;
        }
        compact.push(ch);
    }
    compact
}

/// A call from its JSON object: `name`, and `arguments` or `parameters` (an object, or a string holding
/// one); `None` when it is not one. The arguments are the object's text, compacted (as streamed).
fn parse_call(json: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(json).ok()?;
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => Value::Object(Default::default()),
        Some(Value::String(text)) => serde_json::from_str(text).ok()?,
        Some(arguments) => arguments.clone(),
    };
    if !arguments.is_object() {
        return None;
    }
    let arguments = match json_call_head(json) {
        Some((_, text)) => compact_json(&text[..json_object_len(text)?]),
        None => arguments.to_string(),
    };
    Some(ToolCall { name, arguments })
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

    /// The functions the parser tests call (their schemas type Qwen3-Coder's values).
    pub fn functions() -> Vec<Function> {
        let function = |name: &str, parameters: Value| Function {
            name: name.into(),
            parameters,
        };
        vec![
            function(
                "weather",
                serde_json::json!({"type": "object", "properties": {"city": {"type": "string"},
                    "days": {"type": "integer"}}, "required": ["city"]}),
            ),
            function(
                "time",
                serde_json::json!({"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}),
            ),
        ]
    }

    /// Feeds `text` to a fresh parser in pieces cut at `cuts` (byte offsets on char boundaries).
    pub fn parse_in_pieces(format: ToolCallFormat, text: &str, cuts: &[usize]) -> Parsed {
        let mut parser = format.parser(&functions());
        let mut parsed = Parsed::default();
        let mut start = 0;
        for &cut in cuts.iter().chain([&text.len()]) {
            parsed.append(parser.push(&text[start..cut]));
            start = cut;
        }
        parsed.append(parser.finish());
        parsed
    }

    /// The content and calls of `parsed`, after checking its deltas add up to its calls: per call,
    /// the name first and only first, the arguments concatenated; at least `min_deltas` per call.
    fn checked(parsed: Parsed, min_deltas: usize) -> Parsed {
        for (index, call) in parsed.calls.iter().enumerate() {
            let deltas: Vec<&CallDelta> = parsed.deltas.iter().filter(|d| d.index == index as u32).collect();
            assert!(deltas.len() >= min_deltas, "{call:?} in {} deltas", deltas.len());
            assert_eq!(deltas[0].name.as_ref(), Some(&call.name), "{deltas:?}");
            assert!(deltas[1..].iter().all(|d| d.name.is_none()), "{deltas:?}");
            let arguments: String = deltas.iter().map(|d| d.arguments.as_str()).collect();
            assert_eq!(arguments, call.arguments);
        }
        // Only a call cut off at the end may have deltas and no call.
        assert!(
            parsed.deltas.iter().all(|d| (d.index as usize) <= parsed.calls.len()),
            "deltas of no call: {parsed:?}"
        );
        Parsed {
            deltas: Vec::new(),
            ..parsed
        }
    }

    /// `text` parsed whole equals `expected` (content and calls), and so does every split of it
    /// into two and three pieces, and one character at a time; every time, the deltas add up to the
    /// calls, and one character at a time each call streams in several deltas.
    pub fn check(format: ToolCallFormat, text: &str, expected: &Parsed) {
        let boundaries: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        let parse = |cuts: &[usize]| checked(parse_in_pieces(format, text, cuts), 1);
        assert_eq!(&parse(&[]), expected, "{text:?} whole");
        assert_eq!(
            &checked(parse_in_pieces(format, text, &boundaries), 2),
            expected,
            "{text:?} char by char"
        );
        for (k, &i) in boundaries.iter().enumerate() {
            assert_eq!(&parse(&[i]), expected, "{text:?} cut at {i}");
            for &j in boundaries[k + 1..].iter().step_by(3) {
                assert_eq!(&parse(&[i, j]), expected, "{text:?} cut at {i}, {j}");
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
            deltas: Vec::new(),
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
    fn compacting_a_prefix_gives_a_prefix() {
        let text = "{ \"a b\" : [1, \"\\\" x\"],\n \"c\": {} }";
        let whole = compact_json(text);
        assert_eq!(whole, "{\"a b\":[1,\"\\\" x\"],\"c\":{}}");
        for i in 0..text.len() {
            assert!(whole.starts_with(&compact_json(&text[..i])), "{i}");
        }
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
        assert_eq!(
            ToolCallFormat::detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}"),
            Some(ToolCallFormat::MistralArgs)
        );
        assert_eq!(
            ToolCallFormat::detect("<tool_call>\n<function=' ~ name ~ '>"),
            Some(ToolCallFormat::Qwen3Coder)
        );
        assert_eq!(ToolCallFormat::detect("{{ message.content }}"), None);
    }
}
