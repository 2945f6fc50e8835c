//! Qwen3-Coder tool calls: XML-like blocks, one per call, anywhere in the answer:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A value is raw text for a parameter whose schema is a string, JSON otherwise (text that is not
//! JSON stays a string). The arguments object is built in the order the parameters come, and
//! streamed a parameter at a time.

use serde_json::Value;

use super::{
    super::held_len, hermes, json_rule, lark_string, CallStream, CallsGrammar, Function, Markers, Parsed, ToolCall,
};

pub const START: &str = hermes::START;
pub const END: &str = hermes::END;
pub const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Whether values of `schema` are written as raw text (strings), not JSON.
fn is_text(schema: Option<&Value>) -> bool {
    let Some(schema) = schema else { return false };
    match &schema["type"] {
        Value::String(kind) => kind == "string",
        Value::Null => schema["enum"]
            .as_array()
            .is_some_and(|values| values.iter().all(Value::is_string)),
        _ => false,
    }
}

/// Grammar: one call block, or (`is_parallel`) several, separated by a newline. Each function's
/// parameters come in the order of its schema's `properties`, the required ones always; a string
/// value is any text up to the first `\n</parameter>` (one of its `enum` where it has one), any
/// other value JSON following its schema.
pub(super) fn grammar(functions: &[Function], is_parallel: bool, markers: &Markers) -> CallsGrammar {
    let repeat = if is_parallel { " (\"\\n\" block)*" } else { "" };
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("function_{i}")).collect();
    let mut rules = format!(
        "block: {} rest\nrest: \"\\n\" call \"\\n\" {}\ncall: {}\ntext_value[lazy]: /(.|\\n)*\\n<\\/parameter>/\n",
        markers.lark(START),
        markers.lark(END),
        alternatives.join(" | ")
    );
    for (i, function) in functions.iter().enumerate() {
        let required: Vec<&str> = function.parameters["required"]
            .as_array()
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = lark_string(&format!("{FUNCTION}{}>\n", function.name));
        if let Some(properties) = function.parameters["properties"].as_object() {
            for (j, (name, schema)) in properties.iter().enumerate() {
                let head = lark_string(&format!("{PARAMETER}{name}>\n"));
                let value = match schema["enum"].as_array() {
                    Some(values) if is_text(Some(schema)) => {
                        let values: Vec<String> = values.iter().filter_map(Value::as_str).map(lark_string).collect();
                        format!(
                            "({}) {}",
                            values.join(" | "),
                            lark_string(&format!("\n{PARAMETER_END}"))
                        )
                    }
                    _ if is_text(Some(schema)) => "text_value".to_owned(),
                    _ => format!(
                        "{} {}",
                        json_rule(&with_definitions(schema, &function.parameters)),
                        lark_string(&format!("\n{PARAMETER_END}"))
                    ),
                };
                rules.push_str(&format!("parameter_{i}_{j}: {head} {value} \"\\n\"\n"));
                let optional = if required.contains(&name.as_str()) { "" } else { "?" };
                body.push_str(&format!(" parameter_{i}_{j}{optional}"));
            }
        }
        rules.push_str(&format!("function_{i}: {body} {}\n", lark_string(FUNCTION_END)));
    }
    CallsGrammar {
        after: format!("rest{repeat}"),
        rules,
        untriggered: None,
    }
}

/// A parameter's schema, to be compiled alone, with the definitions of the tool's schema it may
/// refer to (`#/$defs/...`, `#/definitions/...`) copied to its root.
fn with_definitions(schema: &Value, parameters: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(definitions) = parameters.get(key) {
                object.entry(key).or_insert_with(|| definitions.clone());
            }
        }
    }
    schema
}

/// What a call block's text (after the start marker) holds so far.
struct Scan {
    name: String,
    /// The arguments object's text so far (compact JSON, without its closing brace).
    arguments: String,
    /// `</function>` was read; `rest` is what follows it.
    is_complete: bool,
    rest: String,
}

pub struct Qwen3CoderParser {
    /// The schemas of each function's parameters, by name.
    functions: Vec<Function>,
    /// Text not let through yet: a possible start marker, or a call block still open.
    pending: String,
    /// Inside a call block (`pending` starts with the start marker).
    is_in_call: bool,
    /// A call was made: from then on, whitespace between blocks is not content.
    has_calls: bool,
    calls: CallStream,
}

impl Qwen3CoderParser {
    pub fn new(functions: &[Function]) -> Self {
        Self {
            functions: functions.to_vec(),
            pending: String::new(),
            is_in_call: false,
            has_calls: false,
            calls: CallStream::default(),
        }
    }

    /// The value of parameter `name` of function `function`, from its text.
    fn value(&self, function: &str, name: &str, text: &str) -> Value {
        let schema = self
            .functions
            .iter()
            .find(|f| f.name == function)
            .and_then(|f| f.parameters["properties"].get(name));
        if is_text(schema) {
            return Value::from(text);
        }
        serde_json::from_str(text.trim()).unwrap_or_else(|_| Value::from(text))
    }

    /// Reads a block's text after the start marker: `None` until the function's name is known, or
    /// when the text is not laid out as a call.
    fn scan(&self, text: &str) -> Option<Scan> {
        let rest = text.trim_start().strip_prefix(FUNCTION)?;
        let (name, mut rest) = rest.split_once('>')?;
        let mut arguments = String::from("{");
        loop {
            rest = rest.trim_start();
            if let Some(after) = rest.strip_prefix(FUNCTION_END) {
                return Some(Scan {
                    name: name.to_owned(),
                    arguments,
                    is_complete: true,
                    rest: after.to_owned(),
                });
            }
            let partial = Scan {
                name: name.to_owned(),
                arguments: arguments.clone(),
                is_complete: false,
                rest: rest.to_owned(),
            };
            let Some(parameter) = rest.strip_prefix(PARAMETER) else {
                return Some(partial);
            };
            let Some((key, after)) = parameter.split_once('>') else {
                return Some(partial);
            };
            let Some((text, after)) = after.split_once(PARAMETER_END) else {
                return Some(partial);
            };
            let text = text.strip_prefix('\n').unwrap_or(text);
            let text = text.strip_suffix('\n').unwrap_or(text);
            if arguments.len() > 1 {
                arguments.push(',');
            }
            arguments.push_str(&format!("{}:{}", Value::from(key), self.value(name, key, text)));
            rest = after;
        }
    }

    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut parsed = Parsed::default();
        loop {
            if self.is_in_call {
                let Some(end) = self.pending.find(END) else {
                    if let Some(scan) = self.scan(&self.pending[START.len()..]) {
                        self.calls.progress(&scan.name, &scan.arguments, &mut parsed);
                    }
                    return parsed;
                };
                let block: String = self.pending.drain(..end + END.len()).collect();
                match self.scan(&block[START.len()..end]) {
                    Some(scan) if scan.is_complete && scan.rest.trim().is_empty() => {
                        let call = ToolCall {
                            name: scan.name,
                            arguments: scan.arguments + "}",
                        };
                        self.calls.complete(call, &mut parsed);
                        self.has_calls = true;
                    }
                    _ => parsed.content.push_str(&block),
                }
                self.is_in_call = false;
            } else if let Some(start) = self.pending.find(START) {
                let before: String = self.pending.drain(..start).collect();
                parsed.push_free_text(&before, self.has_calls);
                self.is_in_call = true;
            } else {
                let keep = held_len(&self.pending, START);
                let free: String = self.pending.drain(..self.pending.len() - keep).collect();
                parsed.push_free_text(&free, self.has_calls);
                return parsed;
            }
        }
    }

    pub fn finish(&mut self) -> Parsed {
        let rest = std::mem::take(&mut self.pending);
        let mut parsed = Parsed::default();
        if self.is_in_call {
            parsed.content.push_str(&rest);
        } else {
            parsed.push_free_text(&rest, self.has_calls);
        }
        parsed
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        tests::{call, check, parsed},
        ToolCallFormat::Qwen3Coder,
    };

    #[test]
    fn calls_with_typed_values() {
        check(
            Qwen3Coder,
            "Checking.\n<tool_call>\n<function=weather>\n<parameter=city>\n42 \"Paris\"\n</parameter>\n\
<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=time>\n</function>\n</tool_call>",
            &parsed(
                "Checking.\n",
                vec![
                    call("weather", r#"{"city":"42 \"Paris\"","days":3}"#),
                    call("time", "{}"),
                ],
            ),
        );
        // Unknown parameters: JSON where it parses, text otherwise.
        check(
            Qwen3Coder,
            "<tool_call><function=other><parameter=a>[1, 2]</parameter><parameter=b>x y</parameter></function></tool_call>",
            &parsed("", vec![call("other", r#"{"a":[1,2],"b":"x y"}"#)]),
        );
    }

    #[test]
    fn other_answers_are_content() {
        check(Qwen3Coder, "a <tool_c", &parsed("a <tool_c", vec![]));
        check(
            Qwen3Coder,
            "<tool_call>{\"name\": \"f\"}</tool_call> ok",
            &parsed("<tool_call>{\"name\": \"f\"}</tool_call> ok", vec![]),
        );
        check(
            Qwen3Coder,
            "<tool_call>\n<function=time>\n<parameter=zone>\nutc",
            &parsed("<tool_call>\n<function=time>\n<parameter=zone>\nutc", vec![]),
        );
    }
}
