//! JSON text as Python's `json.dumps` writes it: what Hugging Face chat templates' `tojson` gives
//! (transformers defines it with `json.dumps`), and so what models saw of tools and calls in
//! training. Unlike compact JSON: `", "` between items and `": "` after keys (`","` between items
//! when indented), `<`, `>`, `&` and `'` as they are, and non-ASCII characters as they are unless
//! `ensure_ascii`.

use std::fmt::Write;

use serde_json::Value;

/// The keyword arguments of `json.dumps` that templates pass to `tojson`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options {
    /// What each level is indented by, every item on a line of its own; `None`: one line.
    pub indent: Option<String>,
    /// Between items and after keys; `None`: Python's defaults for the `indent`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
    /// Non-ASCII characters as `\uXXXX` escapes (UTF-16 units).
    pub ensure_ascii: bool,
}

/// `value` as `json.dumps(value, **options)` writes it.
pub fn dumps(value: &Value, options: &Options) -> String {
    let (item, key) = match (&options.separators, &options.indent) {
        (Some((item, key)), _) => (item.as_str(), key.as_str()),
        (None, None) => (", ", ": "),
        (None, Some(_)) => (",", ": "),
    };
    let mut out = String::new();
    Writer { options, item, key }.value(&mut out, value, 0);
    out
}

struct Writer<'a> {
    options: &'a Options,
    item: &'a str,
    key: &'a str,
}

impl Writer<'_> {
    fn value(&self, out: &mut String, value: &Value, depth: usize) {
        match value {
            Value::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.before_item(out, i, depth + 1);
                    self.value(out, item, depth + 1);
                }
                self.new_line(out, depth);
                out.push(']');
            }
            Value::Object(object) if !object.is_empty() => {
                let mut entries: Vec<(&String, &Value)> = object.iter().collect();
                if self.options.sort_keys {
                    entries.sort_by_key(|(key, _)| *key);
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    self.before_item(out, i, depth + 1);
                    self.string(out, key);
                    out.push_str(self.key);
                    self.value(out, item, depth + 1);
                }
                self.new_line(out, depth);
                out.push('}');
            }
            Value::String(text) => self.string(out, text),
            // null, booleans, numbers, and empty lists and objects: as JSON has them.
            other => out.push_str(&other.to_string()),
        }
    }

    fn before_item(&self, out: &mut String, index: usize, depth: usize) {
        if index > 0 {
            out.push_str(self.item);
        }
        self.new_line(out, depth);
    }

    fn new_line(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.options.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    /// A string in quotes; serde_json escapes what Python does (`"`, `\`, and control characters).
    fn string(&self, out: &mut String, text: &str) {
        let quoted = Value::from(text).to_string();
        if !self.options.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for ch in quoted.chars() {
            if ch.is_ascii() {
                out.push(ch);
            } else {
                for unit in ch.encode_utf16(&mut [0; 2]) {
                    write!(out, "\\u{unit:04x}").expect("writing to a String");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the tests dump: non-ASCII text, HTML's characters, escapes, every kind of value.
    fn tool() -> Value {
        serde_json::json!({"name": "get_weather", "description": "Wetter in <Städte> & \"Orte\" \u{2014} ok\n",
            "parameters": {"type": "object", "properties": {"z": {"enum": [1, 2.5, true, null]}, "a": {}},
            "required": []}, "emoji": "🦀"})
    }

    // The expected texts are Python 3's `json.dumps` of the same value with the same arguments.

    #[test]
    fn python_defaults() {
        assert_eq!(
            dumps(&tool(), &Options::default()),
            "{\"name\": \"get_weather\", \"description\": \"Wetter in <Städte> & \\\"Orte\\\" \u{2014} ok\\n\", \
             \"parameters\": {\"type\": \"object\", \"properties\": {\"z\": {\"enum\": [1, 2.5, true, null]}, \
             \"a\": {}}, \"required\": []}, \"emoji\": \"🦀\"}"
        );
    }

    #[test]
    fn ensure_ascii_escapes_utf16_units() {
        let options = Options {
            ensure_ascii: true,
            ..Options::default()
        };
        let text = dumps(&tool(), &options);
        assert!(text.is_ascii());
        assert!(text.contains("<St\\u00e4dte> & \\\"Orte\\\" \\u2014 ok\\n"), "{text}");
        assert!(text.ends_with("\"emoji\": \"\\ud83e\\udd80\"}"), "{text}");
    }

    #[test]
    fn indent_and_sort_keys() {
        let options = Options {
            indent: Some("  ".into()),
            sort_keys: true,
            ..Options::default()
        };
        assert_eq!(
            dumps(&tool(), &options),
            "{\n  \"description\": \"Wetter in <Städte> & \\\"Orte\\\" \u{2014} ok\\n\",\n  \"emoji\": \"🦀\",\n  \
             \"name\": \"get_weather\",\n  \"parameters\": {\n    \"properties\": {\n      \"a\": {},\n      \
             \"z\": {\n        \"enum\": [\n          1,\n          2.5,\n          true,\n          null\n        \
             ]\n      }\n    },\n    \"required\": [],\n    \"type\": \"object\"\n  }\n}"
        );
        let options = Options {
            indent: Some(String::new()),
            ..Options::default()
        };
        assert_eq!(
            dumps(&serde_json::json!([[], {}, [1, [2]]]), &options),
            "[\n[],\n{},\n[\n1,\n[\n2\n]\n]\n]"
        );
    }

    #[test]
    fn separators() {
        let options = Options {
            separators: Some((",".into(), ":".into())),
            ..Options::default()
        };
        assert_eq!(dumps(&tool(), &options), serde_json::to_string(&tool()).expect("JSON"));
    }
}
