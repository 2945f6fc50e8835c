//! What a request constrains its output to, in the terms shared by every API (OpenAI's
//! `response_format`, TGI's `grammar`, vLLM's `guided_*`), and its translation for llguidance.

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use serde_json::Value;

use super::GrammarError;
use crate::text::{
    escape_regex,
    reasoning::{THINK_END, THINK_START},
};

/// The name `AfterReasoning` gives its inner grammar.
const ANSWER: &str = "answer";

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
    /// A reasoning model's thinking, free text up to the first `</think>`, then `answer`: a grammar
    /// applies to the answer, never to the reasoning. With `is_open` the output starts inside the
    /// thinking (its template opened it); otherwise it may open with `<think>` or go straight to the answer.
    AfterReasoning { is_open: bool, answer: Box<GrammarSpec> },
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
            GrammarSpec::AfterReasoning { is_open, answer } => {
                format!("after_reasoning:{is_open}:{}", answer.cache_key())
            }
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
            GrammarSpec::AfterReasoning { is_open, answer } => {
                let mut grammar = answer.to_llguidance()?;
                grammar.grammars[0].name = Some(ANSWER.into());
                // `lazy`: the thinking ends at the first `</think>`.
                let end = escape_regex(THINK_END).replace('/', "\\/");
                let thinking = if *is_open {
                    "thinking".to_owned()
                } else {
                    format!("(\"{THINK_START}\" thinking)?")
                };
                let reasoning =
                    format!("start: {thinking} (/[ \\t\\r\\n]+/)? @{ANSWER}\nthinking[lazy]: /(.|\\n)*{end}/\n");
                grammar.grammars.insert(0, GrammarWithLexer::from_lark(reasoning));
                grammar
            }
        })
    }
}
