//! Tool calling on `/v1/chat/completions`, request side: `tools` and `tool_choice` checked, what the
//! chat template gets, and the grammar that makes every call parse and follow its tool's schema.
//!
//! Policy: `tool_choice: "none"` offers no tools at all (the template does not see them and the answer
//! is not parsed for calls), as if the request had none; `auto` (the default when tools are given)
//! shows the tools and lets the model answer in free text, but once it writes the format's trigger
//! (`<tool_call>`, `[TOOL_CALLS]`, a leading `{` for Llama 3) the rest must be calls; `required` and
//! a named function constrain the whole output to calls. Calls are in the model's format, their
//! arguments follow the tools' `parameters` schemas, one call unless `parallel_tool_calls` is true
//! (the default).

use serde_json::{json, Value};

use super::ApiError;
use crate::{
    api::openai::{ChatCompletionRequest, Tool},
    grammar::GrammarSpec,
    text::tool_calls::{Function, Markers, ToolCallFormat},
};

/// What the model must do with the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Call tools or answer, as it likes.
    Auto,
    /// Call at least one tool.
    Required,
    /// Call this function.
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub struct OfferedTools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one answer allowed (`parallel_tool_calls`).
    pub is_parallel: bool,
}

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::InvalidTools {
        message,
        param: param.into(),
    }
}

impl OfferedTools {
    /// The tools a request offers: `None` without tools or with `tool_choice: "none"`; a 400 naming
    /// the field for a tool that is not a function, two tools of one name, `parameters` that are not
    /// a JSON object, or a choice naming no tool given.
    pub fn from_request(request: &ChatCompletionRequest) -> Result<Option<Self>, ApiError> {
        let tools = request.tools.clone().unwrap_or_default();
        let choice = match &request.tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(choice)) => match choice.as_str() {
                "none" => return Ok(None),
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(invalid(
                        "tool_choice",
                        format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got {other:?}"),
                    ))
                }
            },
            Some(named) => match named["function"]["name"].as_str() {
                Some(name) if named["type"] == "function" => ToolChoice::Named(name.to_owned()),
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        format!("`tool_choice` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {named}"),
                    ))
                }
            },
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(invalid(
                    "tool_choice",
                    "`tool_choice` asks for a tool call, but `tools` is empty".into(),
                )),
            };
        }
        for (i, tool) in tools.iter().enumerate() {
            if tool.kind != "function" {
                return Err(invalid(
                    "tools",
                    format!("`tools[{i}].type` must be \"function\", got {:?}", tool.kind),
                ));
            }
            let name = &tool.function.name;
            if name.is_empty() || tools[..i].iter().any(|earlier| earlier.function.name == *name) {
                return Err(invalid(
                    "tools",
                    format!("`tools[{i}].function.name` {name:?} is empty or not unique"),
                ));
            }
            if tool.function.parameters.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(invalid(
                    "tools",
                    format!("`tools[{i}].function.parameters` must be a JSON Schema object"),
                ));
            }
        }
        if let ToolChoice::Named(name) = &choice {
            if !tools.iter().any(|tool| tool.function.name == *name) {
                return Err(invalid(
                    "tool_choice",
                    format!("`tool_choice` names the function {name:?}, which is not among `tools`"),
                ));
            }
        }
        Ok(Some(Self {
            tools,
            choice,
            is_parallel: request.parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// The tools as the chat template's `tools` variable.
    pub fn template_value(&self) -> Value {
        serde_json::to_value(&self.tools).expect("tools serialize")
    }

    /// The tools as the functions the answer may call (what its tool-call parser reads).
    pub fn functions(&self) -> Vec<Function> {
        self.tools
            .iter()
            .map(|tool| Function {
                name: tool.function.name.clone(),
                parameters: tool.function.parameters.clone().unwrap_or(json!({"type": "object"})),
            })
            .collect()
    }

    /// The grammar of the answer: calls (in `format`) of the tools the choice allows, after free text
    /// under `auto`, the format's markers written as `markers` says. Compiling it also checks every
    /// tool's `parameters` schema.
    pub fn grammar(&self, format: ToolCallFormat, markers: &Markers) -> GrammarSpec {
        let functions: Vec<Function> = self
            .functions()
            .into_iter()
            .filter(|function| match &self.choice {
                ToolChoice::Named(name) => function.name == *name,
                _ => true,
            })
            .collect();
        let is_triggered = self.choice == ToolChoice::Auto;
        GrammarSpec::Lark(format.lark(&functions, self.is_parallel, is_triggered, markers))
    }

    /// Whether the output must be calls (not free text first).
    pub fn is_enforced(&self) -> bool {
        self.choice != ToolChoice::Auto
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tool_calls;

    fn request(body: Value) -> ChatCompletionRequest {
        let mut body = body;
        body["messages"] = json!([{"role": "user", "content": "hi"}]);
        serde_json::from_value(body).expect("a valid request")
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}}])
    }

    #[test]
    fn choices_are_read() {
        let offered = |body| OfferedTools::from_request(&request(body)).expect("valid");
        assert!(offered(json!({})).is_none());
        assert!(offered(json!({"tools": weather(), "tool_choice": "none"})).is_none());
        assert_eq!(
            offered(json!({"tools": weather()})).expect("tools").choice,
            ToolChoice::Auto
        );
        let named = offered(json!({"tools": weather(), "parallel_tool_calls": false,
            "tool_choice": {"type": "function", "function": {"name": "weather"}}}))
        .expect("tools");
        assert_eq!(named.choice, ToolChoice::Named("weather".into()));
        assert!(!named.is_parallel);
    }

    fn two_tools() -> Value {
        json!([weather()[0], {"type": "function", "function": {"name": "time", "parameters": {"type":
            "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": false}}}])
    }

    /// `text` read by `format`'s parser: content and calls whose arguments fit the two tools' schemas.
    fn checked_calls(format: ToolCallFormat, offered: &OfferedTools, text: &str) -> tool_calls::Parsed {
        let mut parser = format.parser(&offered.functions());
        let mut parsed = parser.push(text);
        parsed.append(parser.finish());
        for call in &parsed.calls {
            let arguments: Value = serde_json::from_str(&call.arguments).expect("JSON");
            match call.name.as_str() {
                "time" => assert!(
                    ["utc", "cet"].contains(&arguments["zone"].as_str().unwrap_or("")),
                    "{text}"
                ),
                "weather" => assert!(arguments["city"].is_string(), "{text}"),
                other => panic!("called {other} in {text:?}"),
            }
        }
        parsed
    }

    fn formats() -> &'static [ToolCallFormat] {
        <ToolCallFormat as clap::ValueEnum>::value_variants()
    }

    /// Random walks through each format's grammar for a named and a required choice parse back, with
    /// its parser, into calls of the allowed tools whose arguments fit their schemas.
    #[tokio::test]
    async fn enforced_choices_always_parse() {
        for &format in formats() {
            for (choice, parallel) in [
                (json!({"type": "function", "function": {"name": "time"}}), false),
                (json!("required"), true),
            ] {
                let offered = OfferedTools::from_request(&request(json!({"tools": two_tools(), "tool_choice": choice,
                    "parallel_tool_calls": parallel})))
                .expect("valid")
                .expect("tools");
                let grammar =
                    crate::grammar::tests::compile(offered.grammar(format, &crate::grammar::tests::markers())).await;
                let mut num_finished = 0;
                for seed in 0..60 {
                    let (text, finished) = crate::grammar::tests::random_walk(&grammar, seed, 400);
                    if !finished {
                        continue;
                    }
                    num_finished += 1;
                    let parsed = checked_calls(format, &offered, &text);
                    assert!(
                        parsed.content.is_empty() && !parsed.calls.is_empty(),
                        "{format:?} {text:?}: {parsed:?}"
                    );
                    assert!(parallel || parsed.calls.len() == 1, "{text:?}");
                    assert!(parallel || parsed.calls[0].name == "time", "{text:?}");
                }
                assert!(num_finished >= 5, "{format:?}: only {num_finished} walks finished");
            }
        }
    }

    /// Under `auto`, free text may end the answer; once the trigger is written, random walks go on
    /// only into valid calls, and a call that breaks its schema is refused.
    #[tokio::test]
    async fn auto_is_free_text_then_valid_calls() {
        use crate::grammar::tests::{accepts, allows_eos, random_walk_after};
        let offered = OfferedTools::from_request(&request(json!({"tools": two_tools()})))
            .expect("valid")
            .expect("tools");
        for &format in formats() {
            let grammar =
                crate::grammar::tests::compile(offered.grammar(format, &crate::grammar::tests::markers())).await;
            let mut matcher = grammar.matcher();
            assert!(accepts(&mut matcher, "No call: a < b, [TOOL] {x}.\n"), "{format:?}");
            assert!(allows_eos(&mut matcher), "{format:?}");
            let (text, prefix) = match format.trigger() {
                "" => ("", "{".to_owned()),
                trigger => ("Sure. ", format!("Sure. {trigger}")),
            };
            let mut num_finished = 0;
            for seed in 0..40 {
                let (walk, finished) = random_walk_after(&grammar, &prefix, seed, 400);
                if !finished {
                    continue;
                }
                num_finished += 1;
                let parsed = checked_calls(format, &offered, &walk);
                assert!(
                    parsed.content == text && !parsed.calls.is_empty(),
                    "{format:?} {walk:?}: {parsed:?}"
                );
            }
            assert!(num_finished >= 5, "{format:?}: only {num_finished} walks finished");
            // A call of a tool not offered, or arguments off the schema, are refused after the trigger.
            let bad = match format {
                ToolCallFormat::Hermes => "<tool_call>\n{\"name\": \"time\", \"arguments\": {\"zone\": \"pst",
                ToolCallFormat::Llama3 => "{\"name\": \"nope",
                ToolCallFormat::Mistral => "[TOOL_CALLS][{\"name\": \"time\", \"arguments\": {\"city",
                ToolCallFormat::MistralArgs => "[TOOL_CALLS]nope",
                ToolCallFormat::Qwen3Coder => "<tool_call>\n<function=time>\n<parameter=zone>\npst",
            };
            let mut matcher = grammar.matcher();
            assert!(
                !accepts(&mut matcher, &format!("{text}{bad}")),
                "{format:?} accepted {bad:?}"
            );
        }
    }

    /// For a reasoning model the triggered grammar starts after the thinking: the thinking is free
    /// text (calls may be discussed in it), a trigger in the answer starts calls that must be valid.
    #[tokio::test]
    async fn auto_holds_after_the_thinking() {
        use crate::grammar::tests::{accepts, allows_eos};
        let offered = OfferedTools::from_request(&request(json!({"tools": two_tools()})))
            .expect("valid")
            .expect("tools");
        let spec = GrammarSpec::AfterReasoning {
            is_open: true,
            answer: Box::new(offered.grammar(ToolCallFormat::Hermes, &crate::grammar::tests::markers())),
        };
        let grammar = crate::grammar::tests::compile(spec).await;
        let mut matcher = grammar.matcher();
        assert!(accepts(
            &mut matcher,
            "call get_weather? {x}</think>\nSure. <tool_call>\n"
        ));
        assert!(!accepts(&mut matcher, "x"));
        let mut matcher = grammar.matcher();
        assert!(accepts(&mut matcher, "hmm</think>\nNo call needed."));
        assert!(allows_eos(&mut matcher));
    }

    /// A call's JSON is spaced as templates write it, `", "` and `": "` and no other blank, so a
    /// sampled call cannot run on in whitespace. (Qwen3-Coder writes these string values as text.)
    #[tokio::test]
    async fn call_json_is_spaced_as_templates_write_it() {
        use crate::grammar::tests::{accepts, allows_eos};
        let offered = OfferedTools::from_request(&request(json!({"tools": two_tools(), "tool_choice": "required"})))
            .expect("valid")
            .expect("tools");
        for &format in formats() {
            let good = match format {
                ToolCallFormat::Hermes => {
                    "<tool_call>\n{\"name\": \"time\", \"arguments\": {\"zone\": \"utc\"}}\n</tool_call>"
                }
                ToolCallFormat::Llama3 => "{\"name\": \"time\", \"parameters\": {\"zone\": \"utc\"}}",
                ToolCallFormat::Mistral => "[TOOL_CALLS][{\"name\": \"time\", \"arguments\": {\"zone\": \"utc\"}}]",
                ToolCallFormat::MistralArgs => "[TOOL_CALLS]time[ARGS]{\"zone\": \"utc\"}",
                ToolCallFormat::Qwen3Coder => continue,
            };
            let grammar =
                crate::grammar::tests::compile(offered.grammar(format, &crate::grammar::tests::markers())).await;
            let mut matcher = grammar.matcher();
            assert!(
                accepts(&mut matcher, good) && allows_eos(&mut matcher),
                "{format:?}: {good:?}"
            );
            for bad in [
                good.replacen("{\"", "{ \"", 1),
                good.replacen("\": \"", "\":\"", 1),
                good.replacen("\": \"", "\":  \"", 1),
                good.replacen("\"}", "\"\n}", 1),
            ] {
                let mut matcher = grammar.matcher();
                assert!(!accepts(&mut matcher, &bad), "{format:?} accepted {bad:?}");
            }
        }
    }

    /// A tool whose schema refers to its own definitions (`$defs`, as pydantic writes nested models)
    /// gets a grammar in every format, and its calls parse back.
    #[tokio::test]
    async fn a_schema_with_references_is_served() {
        let tools = json!([{"type": "function", "function": {"name": "book", "parameters": {
            "type": "object", "$defs": {"Seat": {"type": "object", "properties": {"row": {"type": "integer"}},
            "required": ["row"], "additionalProperties": false}},
            "properties": {"seat": {"$ref": "#/$defs/Seat"}}, "required": ["seat"], "additionalProperties": false}}}]);
        let offered = OfferedTools::from_request(&request(json!({"tools": tools, "tool_choice": "required"})))
            .expect("valid")
            .expect("tools");
        for &format in formats() {
            let grammar =
                crate::grammar::tests::compile(offered.grammar(format, &crate::grammar::tests::markers())).await;
            let mut num_finished = 0;
            for seed in 0..20 {
                let (text, finished) = crate::grammar::tests::random_walk(&grammar, seed, 400);
                if !finished {
                    continue;
                }
                num_finished += 1;
                let mut parser = format.parser(&offered.functions());
                let mut parsed = parser.push(&text);
                parsed.append(parser.finish());
                assert!(!parsed.calls.is_empty(), "{format:?} {text:?}");
                for call in &parsed.calls {
                    let arguments: Value = serde_json::from_str(&call.arguments).expect("JSON");
                    assert!(arguments["seat"]["row"].is_number(), "{format:?} {text:?}");
                }
            }
            assert!(num_finished >= 5, "{format:?}: only {num_finished} walks finished");
        }
    }

    /// Where the trigger is a special token (as Qwen's `<tool_call>` is), calls start at that token,
    /// and the trigger spelled in plain characters is refused (the parser would read it as a call).
    #[tokio::test]
    async fn a_special_token_trigger_is_the_token() {
        use crate::grammar::tests::accepts;
        let offered = OfferedTools::from_request(&request(json!({"tools": two_tools()})))
            .expect("valid")
            .expect("tools");
        let spec = offered.grammar(ToolCallFormat::Hermes, &crate::grammar::tests::markers());
        assert!(
            matches!(&spec, GrammarSpec::Lark(lark) if lark.contains("<[97]>")),
            "{spec:?}"
        );
        let grammar = crate::grammar::tests::compile(spec).await;
        let mut matcher = grammar.matcher();
        assert!(accepts(&mut matcher, "a <tool_call"));
        assert!(!accepts(&mut matcher, ">"));
    }

    #[test]
    fn bad_tools_are_400s_naming_the_problem() {
        let error = |body| OfferedTools::from_request(&request(body)).unwrap_err();
        let unknown =
            error(json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}));
        assert_eq!(unknown.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(unknown.to_string().contains("\"nope\""), "{unknown}");
        let required = error(json!({"tool_choice": "required"}));
        assert!(required.to_string().contains("`tools` is empty"), "{required}");
        let twice = error(json!({"tools": [weather()[0], weather()[0]]}));
        assert!(twice.to_string().contains("tools[1].function.name"), "{twice}");
        let parameters = error(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}));
        assert!(parameters.to_string().contains("parameters"), "{parameters}");
    }
}
