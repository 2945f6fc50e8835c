//! Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a
//! special token, kept in the text of answers to requests with tools but not of others (say a
//! completion of a rendered prompt), so an answer that starts with `[{` counts as calls too. (The `[TOOL_CALLS]name[ARGS]{...}` form of newer Mistral tokenizers is
//! `mistral_args`.)

use super::{super::held_len, json_call_rule, json_object_len, CallStream, CallsGrammar, Function, Parsed};

pub const START: &str = "[TOOL_CALLS]";

/// Grammar: the marker, then a list of one call or (`is_parallel`) several; without the marker, an
/// answer that starts as a list of objects reads as calls.
pub(super) fn grammar(functions: &[Function], is_parallel: bool) -> CallsGrammar {
    let repeat = if is_parallel { " (\", \" call)*" } else { "" };
    CallsGrammar {
        after: format!("\"[\" call{repeat} \"]\""),
        rules: format!("call: {}\n", json_call_rule(functions, "arguments")),
        untriggered: Some("[ \\t\\r\\n]*\\[[ \\t\\r\\n]*\\{(.|\\n)*"),
    }
}

#[derive(Debug, Default)]
pub struct MistralParser {
    /// Text not let through yet.
    pending: String,
    /// Some text was let through as content already (so a bare `[{` is no longer the answer's start).
    has_content: bool,
    /// Inside the list of calls: `pending` holds its unread rest.
    is_in_calls: bool,
    calls: CallStream,
}

impl MistralParser {
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut parsed = Parsed::default();
        if !self.is_in_calls {
            let trimmed = self.pending.trim_start();
            if !self.has_content && (trimmed.is_empty() || trimmed == "[") {
                return parsed;
            }
            if !self.has_content && trimmed.starts_with('[') && !trimmed.starts_with(START) {
                let is_list = trimmed[1..].trim_start().starts_with('{');
                let is_undecided = trimmed[1..].trim_start().is_empty() || START.starts_with(trimmed);
                if is_undecided {
                    return parsed;
                }
                if is_list {
                    self.pending = trimmed.to_owned();
                    self.is_in_calls = true;
                }
            }
            if !self.is_in_calls {
                if let Some(start) = self.pending.find(START) {
                    parsed.content = self.pending.drain(..start).collect();
                    self.is_in_calls = true;
                } else {
                    let keep = held_len(&self.pending, START);
                    parsed.content = self.pending.drain(..self.pending.len() - keep).collect();
                    self.has_content |= !parsed.content.is_empty();
                    return parsed;
                }
            }
        }
        self.take_calls(&mut parsed);
        parsed
    }

    /// Takes each complete call of the list off the front of `pending` (which may start with the marker).
    fn take_calls(&mut self, parsed: &mut Parsed) {
        loop {
            let rest = self.pending.strip_prefix(START).unwrap_or(&self.pending);
            let rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == '[' || c == ',' || c == ']');
            if !rest.starts_with('{') {
                if !rest.is_empty() {
                    // Not a list of calls after all: what is left is content.
                    parsed.content.push_str(&std::mem::take(&mut self.pending));
                    self.is_in_calls = false;
                    self.has_content = true;
                }
                return;
            }
            let Some(len) = json_object_len(rest) else {
                self.calls.progress_json(rest, parsed);
                return;
            };
            if self.calls.complete_json(&rest[..len], parsed).is_none() {
                parsed.content.push_str(&std::mem::take(&mut self.pending));
                self.is_in_calls = false;
                self.has_content = true;
                return;
            }
            self.pending = rest[len..].to_owned();
        }
    }

    pub fn finish(&mut self) -> Parsed {
        let rest = std::mem::take(&mut self.pending);
        if self.is_in_calls && rest.trim_matches(|c: char| c.is_whitespace() || c == ']').is_empty() {
            return Parsed::default();
        }
        Parsed::content(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        tests::{call, check, parsed},
        ToolCallFormat::Mistral,
    };

    #[test]
    fn calls_after_the_marker_or_as_the_whole_answer() {
        let expected = parsed("", vec![call("weather", r#"{"city":"Paris"}"#), call("time", "{}")]);
        check(
            Mistral,
            "[TOOL_CALLS][{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"time\", \"arguments\": {}}]",
            &expected,
        );
        check(
            Mistral,
            "[{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"time\", \"arguments\": {}}]",
            &expected,
        );
        check(
            Mistral,
            "Sure. [TOOL_CALLS][{\"name\": \"time\", \"arguments\": {}}]",
            &parsed("Sure. ", vec![call("time", "{}")]),
        );
    }

    #[test]
    fn other_answers_are_content() {
        check(Mistral, "[1, 2] and [TOOL", &parsed("[1, 2] and [TOOL", vec![]));
        check(Mistral, "[TOOL_CALLS] nope", &parsed("[TOOL_CALLS] nope", vec![]));
    }
}
