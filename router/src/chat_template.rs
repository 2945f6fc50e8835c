//! Chat templates: the model's own Jinja template (`chat_template.jinja`, or `chat_template` in
//! `tokenizer_config.json`), rendered in the router with minijinja and what Hugging Face templates use:
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, transformers'
//! `tojson` (Python's `json.dumps`), and Python string methods (`.strip()`, `.startswith()`, ...).
//!
//! Tools reach the template as `tools` (OpenAI's tool objects), assistant turns' calls as
//! `message.tool_calls` (with `function.arguments` parsed into an object, as Hugging Face templates
//! expect), tool results as `tool` turns with `tool_call_id`. A template that never mentions `tools`
//! (SmolLM2's, for one) gets them the Hermes way instead: described in the system message, with
//! calls and results written into the turns' text (`text::tool_calls::hermes`), so any chat model can
//! be offered tools; the answer is then read with the Hermes parser.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use thiserror::Error;

use crate::{
    api::openai::{ChatMessage, MessageContent},
    text::{pyjson, tool_calls::hermes},
};

#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("the model has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)")]
    Missing,
    #[error("cannot read the chat template: {0}")]
    Load(String),
    #[error("`messages`: {0}")]
    Render(String),
    #[error("`messages` part of type `{0}` is not supported; only text parts are")]
    UnsupportedPart(String),
}

/// A message as templates see it: content flattened to text.
#[derive(Debug, Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

/// The model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template's source, for what it tells about the model (`text::tool_calls::ToolCallFormat::detect`).
    source: String,
    /// The template renders `tools` itself; otherwise Rill describes them in the system message.
    renders_tools: bool,
}

/// A special token in tokenizer_config.json: a string, or an object with `content`.
fn token_string(value: Option<&serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Loads the template of a Hugging Face model folder; `Ok(None)` when it has none.
    pub fn load(model_dir: &Path) -> Result<Option<Self>, ChatTemplateError> {
        let config: serde_json::Value = match std::fs::read_to_string(model_dir.join("tokenizer_config.json")) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| ChatTemplateError::Load(e.to_string()))?,
            Err(_) => serde_json::Value::Null,
        };
        let source = match std::fs::read_to_string(model_dir.join("chat_template.jinja")) {
            Ok(source) => Some(source),
            Err(_) => match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: use the one named "default".
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_owned),
                _ => None,
            },
        };
        let Some(source) = source else {
            return Ok(None);
        };
        Self::new(
            source,
            token_string(config.get("bos_token")),
            token_string(config.get("eos_token")),
        )
        .map(Some)
    }

    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ChatTemplateError::Load(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            renders_tools: source.contains("tools"),
            source,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template renders `tools` itself (else they are rendered the Hermes way).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// Renders a conversation into the prompt text the model was trained on. `extra` holds further
    /// template variables (the request's `chat_template_kwargs`, `tools`, ...); the standard ones win.
    /// Without `renders_tools`, `tools` and the turns' calls and results are written into the text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut flat = Vec::with_capacity(messages.len());
        for message in messages {
            let mut content = match &message.content {
                None => String::new(),
                Some(MessageContent::Text(text)) => text.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        if part.kind != "text" {
                            return Err(ChatTemplateError::UnsupportedPart(part.kind.clone()));
                        }
                        text.push_str(part.text.as_deref().unwrap_or_default());
                    }
                    text
                }
            };
            let calls = message.tool_calls.as_deref().unwrap_or_default();
            let mut tool_calls = None;
            if self.renders_tools {
                tool_calls = message
                    .tool_calls
                    .is_some()
                    .then(|| calls.iter().map(template_call).collect());
            } else {
                for call in calls {
                    let arguments = arguments_value(&call.function.arguments);
                    content = join(&content, &hermes::render_call(&call.function.name, &arguments));
                }
                if message.tool_call_id.is_some() {
                    content = hermes::render_response(&content);
                }
            }
            flat.push(TemplateMessage {
                role: &message.role,
                content,
                name: message.name.as_deref(),
                tool_calls,
                tool_call_id: message.tool_call_id.as_deref(),
                reasoning_content: message.reasoning_content.as_deref(),
            });
        }
        let mut extra = extra.clone();
        if let Some(tools) = extra.get("tools").filter(|_| !self.renders_tools).cloned() {
            extra.remove("tools");
            let description = hermes::system_prompt(&tools);
            match flat.first_mut().filter(|first| first.role == "system") {
                Some(system) => system.content = join(&system.content, &description),
                None => flat.insert(
                    0,
                    TemplateMessage {
                        role: "system",
                        content: description,
                        name: None,
                        tool_calls: None,
                        tool_call_id: None,
                        reasoning_content: None,
                    },
                ),
            }
        }
        let template = self.env.get_template("chat").expect("added at construction");
        template
            .render(minijinja::context! {
                messages => flat,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                ..minijinja::Value::from_serialize(&extra)
            })
            .map_err(|e| ChatTemplateError::Render(e.to_string()))
    }
}

/// The `tojson` filter as transformers defines it for chat templates: `json.dumps` with its keyword
/// arguments (`indent`, `separators`, `sort_keys`, `ensure_ascii`, off by default), not minijinja's
/// compact and HTML-escaped JSON, so tools and calls read as the model saw them in training.
fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<minijinja::Value, minijinja::Error> {
    let invalid = |message: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {message}"));
    let json = serde_json::to_value(&value).map_err(|e| invalid("cannot serialize to JSON").with_source(e))?;
    let indent = match kwargs.get::<Option<minijinja::Value>>("indent")? {
        Some(indent) if indent.is_none() || indent.is_undefined() => None,
        Some(indent) => Some(match indent.as_str() {
            Some(text) => text.to_owned(),
            None => " ".repeat(usize::try_from(indent).map_err(|_| invalid("`indent` must be a count or a string"))?),
        }),
        None => None,
    };
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) => match <[String; 2]>::try_from(pair) {
            Ok([item, key]) => Some((item, key)),
            Err(_) => return Err(invalid("`separators` must be a pair of strings")),
        },
        None => None,
    };
    let options = pyjson::Options {
        indent,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(minijinja::Value::from_safe_string(pyjson::dumps(&json, &options)))
}

/// Two pieces of a turn's text, a blank line between them when both have some.
fn join(first: &str, second: &str) -> String {
    if first.is_empty() {
        second.to_owned()
    } else {
        format!("{first}\n\n{second}")
    }
}

/// A call's arguments as templates expect them: an object (the JSON text when it is not one).
fn arguments_value(arguments: &str) -> serde_json::Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| arguments.into())
}

/// A call of the history as templates expect it: OpenAI's shape, `arguments` an object.
fn template_call(call: &crate::api::openai::ToolCall) -> serde_json::Value {
    serde_json::json!({
        "id": call.id,
        "type": call.kind,
        "function": {"name": call.function.name, "arguments": arguments_value(&call.function.arguments)},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\\nBe kind.<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + \
message['content'].strip() + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}\
{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_python_string_methods() {
        let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).expect("valid");
        let prompt = template
            .render(
                &[
                    message("user", "  hi  "),
                    message("assistant", "hello"),
                    message("user", "bye"),
                ],
                true,
                &serde_json::Map::new(),
            )
            .expect("renders");
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n\
<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let source =
            "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with user') }}{% endif %}";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).expect("valid");
        let error = template
            .render(&[message("assistant", "x")], false, &serde_json::Map::new())
            .unwrap_err();
        assert!(error.to_string().contains("must start with user"), "{error}");
    }

    #[test]
    fn bos_and_eos_are_available() {
        let template = ChatTemplate::new(
            "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}".into(),
            "<s>".into(),
            "</s>".into(),
        )
        .expect("valid");
        assert_eq!(
            template
                .render(&[message("user", "x")], false, &serde_json::Map::new())
                .expect("renders"),
            "<s>x</s>"
        );
    }

    #[test]
    fn extra_variables_reach_the_template_but_do_not_override_the_standard_ones() {
        let template = ChatTemplate::new(
            "{{ bos_token }}{% if enable_thinking is false %}no-think{% endif %}".into(),
            "<s>".into(),
            "</s>".into(),
        )
        .expect("valid");
        let extra = serde_json::json!({"enable_thinking": false, "bos_token": "<evil>"});
        let extra = extra.as_object().expect("an object");
        assert_eq!(
            template.render(&[message("user", "x")], false, extra).expect("renders"),
            "<s>no-think"
        );
    }

    /// `tojson` is transformers' (`json.dumps`): spaced, `<` and non-ASCII as they are, and its
    /// keyword arguments; the expected texts are Python's.
    #[test]
    fn tojson_writes_as_python_does() {
        let render = |source: &str| {
            let template = ChatTemplate::new(source.into(), String::new(), String::new()).expect("valid");
            let extra = serde_json::json!({"value": {"b": "<Straße> & 'x'", "a": [1, 2.5, null]}});
            template.render(&[], false, extra.as_object().expect("an object"))
        };
        assert_eq!(
            render("{{ value | tojson }}").expect("renders"),
            r#"{"b": "<Straße> & 'x'", "a": [1, 2.5, null]}"#
        );
        assert_eq!(
            render("{{ value | tojson(indent=2, sort_keys=true) }}").expect("renders"),
            "{\n  \"a\": [\n    1,\n    2.5,\n    null\n  ],\n  \"b\": \"<Straße> & 'x'\"\n}"
        );
        assert_eq!(
            render("{{ value | tojson(separators=(',', ':'), ensure_ascii=true) }}").expect("renders"),
            r#"{"b":"<Stra\u00dfe> & 'x'","a":[1,2.5,null]}"#
        );
        let error = render("{{ value | tojson(separators=(',',)) }}").unwrap_err();
        assert!(error.to_string().contains("separators"), "{error}");
    }

    fn tool_history() -> Vec<ChatMessage> {
        let mut call = message("assistant", "");
        call.content = None;
        call.tool_calls = Some(vec![crate::api::openai::ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: crate::api::openai::FunctionCall {
                name: "weather".into(),
                arguments: "{\"city\": \"Paris\"}".into(),
            },
        }]);
        let mut result = message("tool", "sunny");
        result.tool_call_id = Some("call_1".into());
        vec![message("user", "Weather in Paris?"), call, result]
    }

    #[test]
    fn templates_without_tool_support_get_tools_the_hermes_way() {
        let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).expect("valid");
        assert!(!template.renders_tools());
        let extra = serde_json::json!({"tools": [{"type": "function", "function": {"name": "weather"}}]});
        let prompt = template
            .render(&tool_history(), true, extra.as_object().expect("an object"))
            .expect("renders");
        assert!(
            prompt.starts_with("<|im_start|>system\n# Tools\n\nYou may call one or more functions"),
            "{prompt}"
        );
        assert!(
            prompt.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"weather\"}}\n</tools>"),
            "{prompt}"
        );
        assert!(prompt.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"), "{prompt}");
        assert!(
            prompt.contains("<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
            "{prompt}"
        );
    }

    #[test]
    fn templates_with_tool_support_see_tools_and_calls() {
        let source = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}\
{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}\
{% if m.tool_call_id %}{{ m.tool_call_id }}={% endif %}{{ m.content }};{% endfor %}";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).expect("valid");
        assert!(template.renders_tools());
        let extra = serde_json::json!({"tools": [{"type": "function", "function": {"name": "weather"}}]});
        let prompt = template
            .render(&tool_history(), false, extra.as_object().expect("an object"))
            .expect("renders");
        assert_eq!(prompt, "[weather]Weather in Paris?;weather(Paris);call_1=sunny;");
    }
}
