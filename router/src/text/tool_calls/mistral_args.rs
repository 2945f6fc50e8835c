//! Mistral tool calls in the form of newer tokenizers (v11 on: Mistral Small 3.2, Magistral,
//! Devstral): `[TOOL_CALLS]name[ARGS]{...}`, the marker repeated before each call. The markers are
//! read from the text, where they stay even as special tokens ([`ToolCallFormat::markers`](super::ToolCallFormat::markers)).

use serde_json::Value;

use super::{
    super::held_len, compact_json, json_object_len, json_rule, lark_string, CallStream, CallsGrammar, Function,
    Markers, Parsed, ToolCall,
};

pub const START: &str = "[TOOL_CALLS]";
pub const ARGS: &str = "[ARGS]";

/// Grammar: the marker, a function's name, `[ARGS]` and its arguments; again (`is_parallel`) for
/// each further call.
pub(super) fn grammar(functions: &[Function], is_parallel: bool, markers: &Markers) -> CallsGrammar {
    let repeat = if is_parallel {
        format!(" ({} call)*", markers.lark(START))
    } else {
        String::new()
    };
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
    let mut rules = format!("call: {}\n", alternatives.join(" | "));
    for (i, function) in functions.iter().enumerate() {
        let (name, args) = (lark_string(&function.name), markers.lark(ARGS));
        rules.push_str(&format!(
            "call_{i}: {name} {args} {}\n",
            json_rule(&function.parameters)
        ));
    }
    CallsGrammar {
        after: format!("call{repeat}"),
        rules,
        untriggered: None,
    }
}

fn is_name_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || "_-.".contains(ch)
}

#[derive(Debug, Default)]
pub struct MistralArgsParser {
    /// Text not let through yet: a possible marker, or the rest of a call after its marker.
    pending: String,
    /// After a marker (not in `pending`).
    is_in_call: bool,
    /// A call was made: from then on, whitespace between calls is not content.
    has_calls: bool,
    calls: CallStream,
}

impl MistralArgsParser {
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut parsed = Parsed::default();
        loop {
            if !self.is_in_call {
                if let Some(start) = self.pending.find(START) {
                    let before: String = self.pending.drain(..start + START.len()).collect();
                    parsed.push_free_text(&before[..start], self.has_calls);
                    self.is_in_call = true;
                    continue;
                }
                let keep = held_len(&self.pending, START);
                let free: String = self.pending.drain(..self.pending.len() - keep).collect();
                parsed.push_free_text(&free, self.has_calls);
                return parsed;
            }
            let name_len = self.pending.find(|ch| !is_name_char(ch)).unwrap_or(self.pending.len());
            let after = &self.pending[name_len..];
            if !after.starts_with(ARGS) {
                if name_len > 0 && ARGS.starts_with(after) {
                    return parsed;
                }
                if self.pending.is_empty() {
                    return parsed;
                }
                self.not_a_call(&mut parsed);
                continue;
            }
            let name = self.pending[..name_len].to_owned();
            let arguments = after[ARGS.len()..].trim_start();
            if arguments.is_empty() {
                return parsed;
            }
            if !arguments.starts_with('{') {
                self.not_a_call(&mut parsed);
                continue;
            }
            let Some(len) = json_object_len(arguments) else {
                self.calls.progress(&name, arguments, &mut parsed);
                return parsed;
            };
            if !serde_json::from_str::<Value>(&arguments[..len]).is_ok_and(|value| value.is_object()) {
                self.not_a_call(&mut parsed);
                continue;
            }
            let call = ToolCall {
                name,
                arguments: compact_json(&arguments[..len]),
            };
            self.pending = arguments[len..].to_owned();
            self.calls.complete(call, &mut parsed);
            self.is_in_call = false;
            self.has_calls = true;
        }
    }

    /// The marker and what follows it are content after all.
    fn not_a_call(&mut self, parsed: &mut Parsed) {
        parsed.content.push_str(START);
        parsed.content.push_str(&std::mem::take(&mut self.pending));
        self.is_in_call = false;
    }

    pub fn finish(&mut self) -> Parsed {
        let mut parsed = Parsed::default();
        if self.is_in_call {
            self.not_a_call(&mut parsed);
        } else {
            let rest = std::mem::take(&mut self.pending);
            parsed.push_free_text(&rest, self.has_calls);
        }
        parsed
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        tests::{call, check, parsed},
        ToolCallFormat::MistralArgs,
    };

    #[test]
    fn calls_after_their_markers() {
        check(
            MistralArgs,
            "Sure.[TOOL_CALLS]weather[ARGS]{\"city\": \"Paris\", \"days\": 2}[TOOL_CALLS]time[ARGS]{}",
            &parsed(
                "Sure.",
                vec![call("weather", r#"{"city":"Paris","days":2}"#), call("time", "{}")],
            ),
        );
    }

    #[test]
    fn other_answers_are_content() {
        check(MistralArgs, "[TOOL_CALLS] nope", &parsed("[TOOL_CALLS] nope", vec![]));
        check(
            MistralArgs,
            "a [TOOL_CALLS]f[ARGS]3",
            &parsed("a [TOOL_CALLS]f[ARGS]3", vec![]),
        );
        check(
            MistralArgs,
            "[TOOL_CALLS]f[ARGS]{\"a\"",
            &parsed("[TOOL_CALLS]f[ARGS]{\"a\"", vec![]),
        );
        check(MistralArgs, "[TOOL_CALL", &parsed("[TOOL_CALL", vec![]));
    }
}
