//! Tool calling on `/v1/chat/completions`, request side: `tools` and `tool_choice` checked, what the
//! chat template gets, and the grammar that makes `required` and named choices always parse.
//!
//! Policy: `tool_choice: "none"` offers no tools at all (the template does not see them and the answer
//! is not parsed for calls), as if the request had none; `auto` (the default when tools are given)
//! shows the tools and reads whatever calls the model writes; `required` and a named function also
//! constrain the output to calls in the model's format whose arguments follow the tools' `parameters`
//! schemas (one call unless `parallel_tool_calls` is true, the default).

use serde_json::{json, Value};

use super::ApiError;
use crate::{
    api::openai::{ChatCompletionRequest, Tool},
    grammar::GrammarSpec,
    text::tool_calls::ToolCallFormat,
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

    /// The grammar of calls (in `format`) of the tools the choice allows: what `required` and named
    /// choices are held to. Compiling it also checks every tool's `parameters` schema.
    pub fn grammar(&self, format: ToolCallFormat) -> GrammarSpec {
        let calls: Vec<Value> = self
            .tools
            .iter()
            .filter(|tool| match &self.choice {
                ToolChoice::Named(name) => tool.function.name == *name,
                _ => true,
            })
            .map(|tool| {
                let parameters = tool.function.parameters.clone().unwrap_or(json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {"name": {"const": tool.function.name}, format.arguments_key(): parameters},
                    "required": ["name", format.arguments_key()],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = format!("%json {}", json!({"anyOf": calls}));
        GrammarSpec::Lark(format.lark(&call, self.is_parallel))
    }

    /// Whether the output must be calls (the grammar applies).
    pub fn is_enforced(&self) -> bool {
        self.choice != ToolChoice::Auto
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Random walks through each format's grammar for a named and a required choice parse back, with
    /// its parser, into calls of the allowed tools whose arguments fit their schemas.
    #[tokio::test]
    async fn enforced_choices_always_parse() {
        let tools = json!([weather()[0], {"type": "function", "function": {"name": "time", "parameters": {"type":
            "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": false}}}]);
        for format in [ToolCallFormat::Hermes, ToolCallFormat::Llama3, ToolCallFormat::Mistral] {
            for (choice, parallel) in [
                (json!({"type": "function", "function": {"name": "time"}}), false),
                (json!("required"), true),
            ] {
                let offered = OfferedTools::from_request(&request(json!({"tools": tools, "tool_choice": choice,
                    "parallel_tool_calls": parallel})))
                .expect("valid")
                .expect("tools");
                let grammar = crate::grammar::tests::compile(offered.grammar(format)).await;
                let mut num_finished = 0;
                for seed in 0..60 {
                    let (text, finished) = crate::grammar::tests::random_walk(&grammar, seed, 400);
                    if !finished {
                        continue;
                    }
                    num_finished += 1;
                    let mut parser = format.parser();
                    let mut parsed = parser.push(&text);
                    parsed.append(parser.finish());
                    assert!(
                        parsed.content.is_empty() && !parsed.calls.is_empty(),
                        "{format:?} {text:?}: {parsed:?}"
                    );
                    assert!(parallel || parsed.calls.len() == 1, "{text:?}");
                    for call in &parsed.calls {
                        let arguments: Value = serde_json::from_str(&call.arguments).expect("JSON");
                        match call.name.as_str() {
                            "time" => assert!(
                                ["utc", "cet"].contains(&arguments["zone"].as_str().unwrap_or("")),
                                "{text}"
                            ),
                            "weather" => assert!(parallel && arguments["city"].is_string(), "{text}"),
                            other => panic!("called {other} in {text:?}"),
                        }
                    }
                }
                assert!(num_finished >= 5, "{format:?}: only {num_finished} walks finished");
            }
        }
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
