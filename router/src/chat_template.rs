//! Chat templates: the model's own Jinja template (`chat_template.jinja`, or `chat_template` in
//! `tokenizer_config.json`), rendered in the router with minijinja and what Hugging Face templates use:
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, and Python string
//! methods (`.strip()`, `.startswith()`, ...).

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use thiserror::Error;

use crate::api::openai::{ChatMessage, MessageContent};

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
}

/// The model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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
        env.add_template_owned("chat", source)
            .map_err(|e| ChatTemplateError::Load(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders a conversation into the prompt text the model was trained on. `extra` holds further
    /// template variables (the request's `chat_template_kwargs`, `tools`, ...); the standard ones win.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let mut flat = Vec::with_capacity(messages.len());
        for message in messages {
            let content = match &message.content {
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
            flat.push(TemplateMessage {
                role: &message.role,
                content,
                name: message.name.as_deref(),
            });
        }
        let template = self.env.get_template("chat").expect("added at construction");
        template
            .render(minijinja::context! {
                messages => flat,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                ..minijinja::Value::from_serialize(extra)
            })
            .map_err(|e| ChatTemplateError::Render(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
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
}
