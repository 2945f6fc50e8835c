//! What a request constrains its output to, in the terms shared by every API (OpenAI's
//! `response_format`, TGI's `grammar`, vLLM's `guided_*`), and its translation for llguidance.

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

use super::GrammarError;

/// The language a constrained request's output must belong to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// JSON that validates against this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// A Lark grammar (llguidance's dialect; `start` is the top rule).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl GrammarSpec {
    /// The cache key: equal keys compile to the same grammar.
    pub fn cache_key(&self) -> String {
        match self {
            GrammarSpec::JsonSchema(schema) => format!("json_schema:{schema}"),
            GrammarSpec::JsonObject => "json_object".into(),
            GrammarSpec::Regex(regex) => format!("regex:{regex}"),
            GrammarSpec::Lark(lark) => format!("lark:{lark}"),
            GrammarSpec::Choice(choices) => format!("choice:{}", Value::from(choices.clone())),
        }
    }

    pub fn to_llguidance(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            GrammarSpec::JsonSchema(schema) => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(GrammarError::Invalid(format!(
                        "a JSON Schema must be an object or a boolean, got {schema}"
                    )));
                }
                TopLevelGrammar::from_json_schema(schema.clone())
            }
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            GrammarSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                let alternatives: Vec<String> = choices.iter().map(|choice| escape_regex(choice)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
        })
    }
}

/// `text` as a regex that matches exactly it.
fn escape_regex(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            escaped.push('\\');
        }
        escaped.push(ch);
    }
    escaped
}
