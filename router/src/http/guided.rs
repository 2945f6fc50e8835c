//! The grammar a request asks for, from whichever API field gave it: OpenAI's `response_format`,
//! vLLM's `guided_*` and `structured_outputs`, TGI's `grammar`. At most one may be given.

use serde_json::Value;

use super::ApiError;
use crate::{
    api::openai::{GuidedFields, ResponseFormat},
    grammar::GrammarSpec,
    validation::ValidationError,
};

/// A grammar and the field that gave it.
pub type FieldGrammar = (GrammarSpec, &'static str);

/// A JSON Schema given as an object, or as a string holding one (as vLLM accepts).
fn schema(value: &Value, field: &'static str) -> Result<GrammarSpec, ApiError> {
    match value {
        Value::String(text) => serde_json::from_str(text)
            .map(GrammarSpec::JsonSchema)
            .map_err(|e| ValidationError::InvalidGrammar(field, format!("the schema is not JSON: {e}")).into()),
        other => Ok(GrammarSpec::JsonSchema(other.clone())),
    }
}

/// The grammar of the OpenAI/vLLM fields, if any; a 422 when several are given.
pub fn from_openai(fields: &GuidedFields) -> Result<Option<FieldGrammar>, ApiError> {
    let mut found: Vec<FieldGrammar> = Vec::new();
    match &fields.response_format {
        None | Some(ResponseFormat::Text) => {}
        Some(ResponseFormat::JsonObject) => found.push((GrammarSpec::JsonObject, "response_format")),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let spec = match &json_schema.schema {
                Some(value) => schema(value, "response_format")?,
                None => GrammarSpec::JsonSchema(Value::Bool(true)),
            };
            found.push((spec, "response_format"));
        }
    }
    if let Some(value) = &fields.guided_json {
        found.push((schema(value, "guided_json")?, "guided_json"));
    }
    if let Some(regex) = &fields.guided_regex {
        found.push((GrammarSpec::Regex(regex.clone()), "guided_regex"));
    }
    if let Some(lark) = &fields.guided_grammar {
        found.push((GrammarSpec::Lark(lark.clone()), "guided_grammar"));
    }
    if let Some(choices) = &fields.guided_choice {
        found.push((GrammarSpec::Choice(choices.clone()), "guided_choice"));
    }
    if let Some(outputs) = &fields.structured_outputs {
        let field = "structured_outputs";
        if let Some(value) = &outputs.json {
            found.push((schema(value, field)?, field));
        }
        if let Some(regex) = &outputs.regex {
            found.push((GrammarSpec::Regex(regex.clone()), field));
        }
        if let Some(choices) = &outputs.choice {
            found.push((GrammarSpec::Choice(choices.clone()), field));
        }
        if let Some(lark) = &outputs.grammar {
            found.push((GrammarSpec::Lark(lark.clone()), field));
        }
        if outputs.json_object {
            found.push((GrammarSpec::JsonObject, field));
        }
    }
    at_most_one(found)
}

/// TGI's `grammar`: `{"type": "json", "value": schema}`, `{"type": "regex", "value": "..."}`, or
/// `{"type": "json_schema", "value": {"name", "schema"}}`.
pub fn from_tgi(grammar: &Value) -> Result<Option<FieldGrammar>, ApiError> {
    const FIELD: &str = "parameters.grammar";
    let invalid = |message: &str| ApiError::from(ValidationError::InvalidGrammar(FIELD, message.into()));
    if grammar.is_null() {
        return Ok(None);
    }
    let value = &grammar["value"];
    let spec = match grammar["type"].as_str() {
        Some("json") => schema(value, FIELD)?,
        Some("json_schema") => schema(&value["schema"], FIELD)?,
        Some("regex") => GrammarSpec::Regex(
            value
                .as_str()
                .ok_or_else(|| invalid("a regex grammar's `value` must be a string"))?
                .to_owned(),
        ),
        _ => return Err(invalid("`type` must be \"json\", \"json_schema\" or \"regex\"")),
    };
    Ok(Some((spec, FIELD)))
}

fn at_most_one(mut found: Vec<FieldGrammar>) -> Result<Option<FieldGrammar>, ApiError> {
    if found.len() > 1 {
        let names: Vec<String> = found.iter().map(|(_, field)| format!("`{field}`")).collect();
        return Err(ApiError::Unsupported {
            message: format!("give at most one constraint on the output, got {}", names.join(", ")),
            param: found[1].1.into(),
        });
    }
    Ok(found.pop())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guided(body: Value) -> GuidedFields {
        serde_json::from_value(body).expect("valid fields")
    }

    #[test]
    fn each_api_field_gives_its_grammar() {
        let cases = [
            (
                serde_json::json!({"response_format": {"type": "json_object"}}),
                GrammarSpec::JsonObject,
            ),
            (
                serde_json::json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}}}),
                GrammarSpec::JsonSchema(serde_json::json!({"type": "integer"})),
            ),
            (
                serde_json::json!({"guided_json": "{\"type\": \"string\"}"}),
                GrammarSpec::JsonSchema(serde_json::json!({"type": "string"})),
            ),
            (
                serde_json::json!({"guided_regex": "a+"}),
                GrammarSpec::Regex("a+".into()),
            ),
            (
                serde_json::json!({"guided_grammar": "start: \"a\""}),
                GrammarSpec::Lark("start: \"a\"".into()),
            ),
            (
                serde_json::json!({"guided_choice": ["a", "b"]}),
                GrammarSpec::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                serde_json::json!({"structured_outputs": {"regex": "b"}}),
                GrammarSpec::Regex("b".into()),
            ),
        ];
        for (body, expected) in cases {
            let (spec, _) = from_openai(&guided(body.clone())).expect("valid").expect("a grammar");
            assert_eq!(spec, expected, "{body}");
        }
        assert!(
            from_openai(&guided(serde_json::json!({"response_format": {"type": "text"}})))
                .expect("valid")
                .is_none()
        );
    }

    #[test]
    fn two_constraints_are_refused() {
        let fields = guided(serde_json::json!({"guided_regex": "a", "response_format": {"type": "json_object"}}));
        let error = from_openai(&fields).unwrap_err();
        assert!(error.to_string().contains("`guided_regex`"), "{error}");
    }

    #[test]
    fn tgi_grammars() {
        let (spec, _) = from_tgi(&serde_json::json!({"type": "regex", "value": "[0-9]+"}))
            .expect("valid")
            .expect("a grammar");
        assert_eq!(spec, GrammarSpec::Regex("[0-9]+".into()));
        assert!(from_tgi(&serde_json::json!({"type": "yaml", "value": ""})).is_err());
        assert!(from_tgi(&Value::Null).expect("valid").is_none());
    }
}
