//! Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (or
//! `"arguments"`), optionally after `<|python_tag|>` (which disappears from the text when special
//! tokens are skipped), several calls separated by `;`. An answer that does not start with `{` (after
//! the tag and whitespace) is plain content.

use super::{json_call_rule, json_object_len, CallStream, CallsGrammar, Function, Parsed};

pub const PYTHON_TAG: &str = "<|python_tag|>";

/// Grammar: one call object, or (`is_parallel`) several separated by `; `; without a trigger, an
/// answer is calls when it starts with `{`.
pub(super) fn grammar(functions: &[Function], is_parallel: bool) -> CallsGrammar {
    let repeat = if is_parallel { " (\"; \" call)*" } else { "" };
    CallsGrammar {
        after: format!("call{repeat}"),
        rules: format!("call: {}\n", json_call_rule(functions, "parameters")),
        untriggered: Some("[ \\t\\r\\n]*\\{(.|\\n)*"),
    }
}

#[derive(Debug, Default)]
pub struct Llama3Parser {
    /// Text not let through yet.
    pending: String,
    state: State,
    calls: CallStream,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace (or part of the tag) yet: a call or content may follow.
    #[default]
    Start,
    /// The answer is calls: objects and separators.
    Calls,
    /// The answer is content: everything passes through.
    Content,
}

impl Llama3Parser {
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        if self.state == State::Start {
            let rest = self.pending.trim_start();
            let rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
            if rest.starts_with('{') {
                self.pending = rest.to_owned();
                self.state = State::Calls;
            } else if rest.is_empty() || (PYTHON_TAG.starts_with(rest) && !self.pending.contains(PYTHON_TAG)) {
                return Parsed::default();
            } else {
                self.state = State::Content;
            }
        }
        match self.state {
            State::Content => Parsed::content(std::mem::take(&mut self.pending)),
            _ => self.take_calls(),
        }
    }

    /// Takes every complete call off the front of `pending`; on anything else, the rest is content.
    fn take_calls(&mut self) -> Parsed {
        let mut parsed = Parsed::default();
        loop {
            let rest = self.pending.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
            if rest.is_empty() {
                return parsed;
            }
            if !rest.starts_with('{') {
                self.state = State::Content;
                parsed.content = std::mem::take(&mut self.pending);
                return parsed;
            }
            let Some(len) = json_object_len(rest) else {
                self.calls.progress_json(rest, &mut parsed);
                return parsed;
            };
            if self.calls.complete_json(&rest[..len], &mut parsed).is_none() {
                self.state = State::Content;
                parsed.content = std::mem::take(&mut self.pending);
                return parsed;
            }
            self.pending = rest[len..].to_owned();
        }
    }

    pub fn finish(&mut self) -> Parsed {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Calls if rest.trim_matches(|c: char| c.is_whitespace() || c == ';').is_empty() => Parsed::default(),
            _ => Parsed::content(rest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        tests::{call, check, parsed},
        ToolCallFormat::Llama3,
    };

    #[test]
    fn calls_with_parameters_or_arguments() {
        check(
            Llama3,
            "<|python_tag|>{\"name\": \"weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"time\", \"arguments\": {}}",
            &parsed("", vec![call("weather", r#"{"city":"Paris"}"#), call("time", "{}")]),
        );
        check(
            Llama3,
            " {\"name\": \"f\", \"parameters\": {\"s\": \"}\"}}",
            &parsed("", vec![call("f", r#"{"s":"}"}"#)]),
        );
    }

    #[test]
    fn other_answers_are_content() {
        check(Llama3, "The answer is {42}.", &parsed("The answer is {42}.", vec![]));
        check(Llama3, "{not json}", &parsed("{not json}", vec![]));
        check(
            Llama3,
            "{\"name\": \"f\", \"param",
            &parsed("{\"name\": \"f\", \"param", vec![]),
        );
    }
}
