//! Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
//! per call, anywhere in the answer. Rill also offers tools in this format to models whose templates
//! have no tool support of their own (`chat_template`): [`system_prompt`], [`render_call`] and
//! [`render_response`] write the tools, calls and results as Qwen2.5's template does.

use super::{super::held_len, super::pyjson, json_call_rule, CallStream, CallsGrammar, Function, Markers, Parsed};

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// Grammar: one call block, or (`is_parallel`) several, separated by a newline.
pub(super) fn grammar(functions: &[Function], is_parallel: bool, markers: &Markers) -> CallsGrammar {
    let repeat = if is_parallel { " (\"\\n\" block)*" } else { "" };
    CallsGrammar {
        after: format!("rest{repeat}"),
        rules: format!(
            "block: {} rest\nrest: \"\\n\" call \"\\n\" {}\ncall: {}\n",
            markers.lark(START),
            markers.lark(END),
            json_call_rule(functions, "arguments")
        ),
        untriggered: None,
    }
}

/// The system message's description of `tools` (a list of OpenAI tool objects) and of how to call them.
pub fn system_prompt(tools: &serde_json::Value) -> String {
    let tools: Vec<String> = tools
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|tool| pyjson::dumps(tool, &pyjson::Options::default()))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
For each function call, return a json object with function name and arguments within \
{START}{END} XML tags:\n{START}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{END}",
        tools.join("\n")
    )
}

/// A tool's result as a `tool` turn's text.
pub fn render_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// The text of a call as the model writes it (for assistant turns given back in the history): spaced
/// as the call grammar makes the model write it, so a re-rendered turn is the tokens it generated.
pub fn render_call(name: &str, arguments: &serde_json::Value) -> String {
    let call = serde_json::json!({"name": name, "arguments": arguments});
    format!("{START}\n{}\n{END}", pyjson::dumps(&call, &pyjson::Options::default()))
}

#[derive(Debug, Default)]
pub struct HermesParser {
    /// Text not let through yet: a possible start marker, or a call block still open.
    pending: String,
    /// Inside a call block (`pending` starts with the start marker).
    is_in_call: bool,
    /// A call was made: from then on, whitespace between blocks is not content.
    has_calls: bool,
    calls: CallStream,
}

impl HermesParser {
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut parsed = Parsed::default();
        loop {
            if self.is_in_call {
                let Some(end) = self.pending.find(END) else {
                    self.calls.progress_json(&self.pending[START.len()..], &mut parsed);
                    return parsed;
                };
                let block: String = self.pending.drain(..end + END.len()).collect();
                match self.calls.complete_json(block[START.len()..end].trim(), &mut parsed) {
                    Some(()) => self.has_calls = true,
                    None => parsed.content.push_str(&block),
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
        ToolCallFormat::Hermes,
    };

    #[test]
    fn calls_between_content() {
        check(
            Hermes,
            "Let me check.<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
            &parsed(
                "Let me check.",
                vec![call("weather", r#"{"city":"Paris"}"#), call("time", "{}")],
            ),
        );
    }

    #[test]
    fn plain_text_and_lookalikes_stay_content() {
        check(
            Hermes,
            "a < b, <tool or <tool_cal",
            &parsed("a < b, <tool or <tool_cal", vec![]),
        );
        check(
            Hermes,
            "<tool_call>not json</tool_call> ok",
            &parsed("<tool_call>not json</tool_call> ok", vec![]),
        );
        check(
            Hermes,
            "x<tool_call>{\"name\": \"f\"",
            &parsed("x<tool_call>{\"name\": \"f\"", vec![]),
        );
    }

    #[test]
    fn the_grammar_text_parses_back() {
        let text = format!(
            "{}\n{}",
            super::render_call("f", &serde_json::json!({"x": [1, "}"]})),
            super::render_call("g", &serde_json::json!({}))
        );
        check(
            Hermes,
            &text,
            &parsed("", vec![call("f", r#"{"x":[1,"}"]}"#), call("g", "{}")]),
        );
    }
}
