//! How the OpenAI API treats fields Rill does not act on. Policy, decided once here:
//! - fields OpenAI defines but Rill does not implement (`InertFields`) are accepted at their default
//!   value (absent, `null`, `false`, "text"-like values) and otherwise get a 422 naming them, so a client
//!   never silently gets something other than what it asked for;
//! - fields nobody defines (typos, other servers' extensions) are accepted and ignored, as vLLM does,
//!   with a warning in the log and `rill_ignored_request_fields_total{field}` counted, so clients that
//!   send extra fields keep working and operators can still see them.

use super::{ApiError, RequestTag};
use crate::{
    api::openai::{InertFields, UnknownFields},
    metrics::Metrics,
};

/// The inert fields a request set away from their defaults, by name.
fn non_default_fields(fields: &InertFields) -> Vec<&'static str> {
    let is_null_or = |value: &Option<String>, defaults: &[&str]| value.as_deref().is_none_or(|v| defaults.contains(&v));
    let checks = [
        ("store", fields.store != Some(true)),
        ("metadata", fields.metadata.as_ref().is_none_or(|m| m.is_empty())),
        ("service_tier", is_null_or(&fields.service_tier, &["auto", "default"])),
        (
            "modalities",
            fields
                .modalities
                .as_ref()
                .is_none_or(|m| m.iter().all(|kind| kind == "text")),
        ),
        ("audio", fields.audio.as_ref().is_none_or(|v| v.is_null())),
        ("prediction", fields.prediction.as_ref().is_none_or(|v| v.is_null())),
        (
            "web_search_options",
            fields.web_search_options.as_ref().is_none_or(|v| v.is_null()),
        ),
        ("functions", fields.functions.as_ref().is_none_or(|f| f.is_empty())),
        (
            "function_call",
            fields
                .function_call
                .as_ref()
                .is_none_or(|v| v.is_null() || v.as_str() == Some("none")),
        ),
        ("verbosity", is_null_or(&fields.verbosity, &["medium"])),
        ("suffix", is_null_or(&fields.suffix, &[""])),
        ("best_of", fields.best_of.is_none_or(|n| n == 1)),
    ];
    checks
        .into_iter()
        .filter_map(|(name, is_default)| (!is_default).then_some(name))
        .collect()
}

/// A 422 naming the first inert field set away from its default.
pub fn check_inert(fields: &InertFields) -> Result<(), ApiError> {
    match non_default_fields(fields).as_slice() {
        [] => Ok(()),
        names => Err(ApiError::Unsupported {
            message: format!(
                "not supported by this server except at their default value: {}",
                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            ),
            param: names[0].to_owned(),
        }),
    }
}

/// Logs and counts the unknown fields of a request, which is then served without them.
pub fn ignore_unknown(metrics: &Metrics, tag: &RequestTag, unknown: &UnknownFields) {
    if unknown.is_empty() {
        return;
    }
    let names: Vec<&str> = unknown.keys().map(String::as_str).collect();
    tracing::warn!(request_id = %tag.id, fields = ?names, "ignoring unknown request fields");
    for name in names {
        metrics.count_ignored_field(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inert(body: serde_json::Value) -> InertFields {
        serde_json::from_value(body).expect("valid inert fields")
    }

    #[test]
    fn defaults_pass_and_others_are_named() {
        let defaults = inert(serde_json::json!({
            "store": false, "metadata": {}, "service_tier": "auto", "modalities": ["text"], "audio": null,
            "functions": [], "function_call": "none", "best_of": 1, "suffix": null, "verbosity": null,
        }));
        assert!(non_default_fields(&defaults).is_empty());
        let asked = inert(serde_json::json!({"store": true, "modalities": ["text", "audio"], "best_of": 3}));
        assert_eq!(non_default_fields(&asked), ["store", "modalities", "best_of"]);
    }
}
