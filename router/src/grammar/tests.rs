//! Grammar tests over a one-character-per-token vocabulary: seeded random walks through each mask
//! always end in a sentence of the grammar, and bad grammars are errors naming the problem.

use rand::{rngs::StdRng, Rng, SeedableRng};
use tokenizers::{models::bpe::BPE, pre_tokenizers::byte_level::ByteLevel, AddedToken, Tokenizer};

use super::*;
use crate::text::tool_calls::Markers;

/// Printable ASCII, one token per character (ids 0..95, byte-level: the space is `Ġ`), then `<eos>`
/// (id 95), a newline (id 96), and `<tool_call>` (97) and `</tool_call>` (98) as added tokens (as in
/// Qwen's tokenizer, where llguidance counts them as special tokens); logits have 100 entries.
const EOS: u32 = 95;
const NEWLINE: u32 = 96;
const TOOL_CALL: u32 = 97;
const TOOL_CALL_END: u32 = 98;
const ADDED: [(u32, &str); 3] = [
    (NEWLINE, "\n"),
    (TOOL_CALL, "<tool_call>"),
    (TOOL_CALL_END, "</tool_call>"),
];
const VOCAB_SIZE: u32 = 100;

/// The token of a character of the test vocabulary.
pub(crate) fn token_of(ch: char) -> u32 {
    if ch == '\n' {
        NEWLINE
    } else {
        u32::from(ch) - u32::from(b' ')
    }
}

/// The tokens of `text`: its added tokens whole, every other character alone.
fn tokens_of(mut text: &str) -> Vec<u32> {
    let mut tokens = Vec::new();
    while let Some(ch) = text.chars().next() {
        match ADDED.iter().find(|(_, added)| text.starts_with(added)) {
            Some(&(token, added)) => {
                tokens.push(token);
                text = &text[added.len()..];
            }
            None => {
                tokens.push(token_of(ch));
                text = &text[ch.len_utf8()..];
            }
        }
    }
    tokens
}

fn text_of(token: u32) -> String {
    match ADDED.iter().find(|(added, _)| *added == token) {
        Some((_, text)) => (*text).to_owned(),
        None => char::from(b' ' + token as u8).to_string(),
    }
}

/// How grammars for the test vocabulary write tool-call markers.
pub(crate) fn markers() -> Markers<'static> {
    fn special_token(text: &str) -> Option<u32> {
        compiler().special_token(text)
    }
    Markers(&special_token)
}

/// One compiler for every test (they run in parallel; its cache is shared).
pub(crate) fn compiler() -> GrammarCompiler {
    static COMPILER: std::sync::OnceLock<GrammarCompiler> = std::sync::OnceLock::new();
    COMPILER.get_or_init(build_compiler).clone()
}

fn build_compiler() -> GrammarCompiler {
    let token = |i: u32| match i {
        0 => "Ġ".to_owned(),
        _ => char::from(b' ' + i as u8).to_string(),
    };
    let vocab: tokenizers::models::bpe::Vocab = (0u32..95).map(|i| (token(i), i)).collect();
    // Byte-level BPE without merges: every character is its own token.
    let model = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .expect("valid BPE model");
    let mut tokenizer = Tokenizer::new(model);
    let byte_level = ByteLevel::default().add_prefix_space(false);
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));
    tokenizer.add_special_tokens(&[AddedToken::from("<eos>", true)]);
    tokenizer.add_tokens(&[
        AddedToken::from("\n", false),
        AddedToken::from("<tool_call>", false),
        AddedToken::from("</tool_call>", false),
    ]);
    let dir = std::env::temp_dir().join(format!("rill-grammar-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).expect("saved tokenizer");
    GrammarCompiler::new(&path, &[EOS], VOCAB_SIZE).expect("compiler")
}

fn is_allowed(mask: &[u32], token: u32) -> bool {
    mask.get(token as usize / 32)
        .is_some_and(|word| word >> (token % 32) & 1 == 1)
}

/// Samples uniformly among the allowed tokens until EOS; returns the text and whether EOS ended it.
pub(crate) fn random_walk(grammar: &CompiledGrammar, seed: u64, max_tokens: usize) -> (String, bool) {
    random_walk_after(grammar, "", seed, max_tokens)
}

/// Whether `text` (one token per character) is accepted: its tokens allowed one after the other.
pub(crate) fn accepts(matcher: &mut GrammarMatcher, text: &str) -> bool {
    tokens_of(text)
        .into_iter()
        .all(|token| is_allowed(&matcher.allowed_tokens().expect("mask"), token) && matcher.accept(token).is_ok())
}

/// Whether EOS is allowed now.
pub(crate) fn allows_eos(matcher: &mut GrammarMatcher) -> bool {
    is_allowed(&matcher.allowed_tokens().expect("mask"), EOS)
}

/// [`random_walk`] from the state after `prefix` (which must be accepted), its text included.
pub(crate) fn random_walk_after(
    grammar: &CompiledGrammar,
    prefix: &str,
    seed: u64,
    max_tokens: usize,
) -> (String, bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut matcher = grammar.matcher();
    assert!(accepts(&mut matcher, prefix), "{prefix:?} refused");
    let mut text = prefix.to_owned();
    for _ in 0..max_tokens {
        let mask = matcher.allowed_tokens().expect("mask");
        let allowed: Vec<u32> = (0..VOCAB_SIZE).filter(|&t| is_allowed(&mask, t)).collect();
        assert!(!allowed.is_empty(), "an empty mask after {text:?}");
        assert!(
            allowed.iter().all(|&t| t <= TOOL_CALL_END),
            "padding tokens allowed: {allowed:?}"
        );
        // Prefer continuing, so walks explore long outputs, but take EOS sometimes when allowed.
        let token = if allowed.contains(&EOS) && (allowed.len() == 1 || rng.random_bool(0.3)) {
            EOS
        } else {
            let choices: Vec<u32> = allowed.into_iter().filter(|&t| t != EOS).collect();
            choices[rng.random_range(0..choices.len())]
        };
        if token == EOS {
            assert!(
                matcher.is_complete(),
                "EOS allowed before the grammar was complete: {text:?}"
            );
            return (text, true);
        }
        matcher.accept(token).expect("an allowed token is accepted");
        text.push_str(&text_of(token));
    }
    (text, false)
}

pub(crate) async fn compile(spec: GrammarSpec) -> CompiledGrammar {
    compiler().compile(&spec).await.expect("compiles")
}

#[tokio::test]
async fn random_walks_through_a_schema_yield_valid_json() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        },
        "required": ["name", "kind"],
        "additionalProperties": false,
    });
    let grammar = compile(GrammarSpec::JsonSchema(schema)).await;
    let mut num_finished = 0;
    for seed in 0..40 {
        let (text, finished) = random_walk(&grammar, seed, 400);
        if !finished {
            continue;
        }
        num_finished += 1;
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value["name"].as_str().is_some_and(|n| n.chars().count() <= 5), "{text}");
        assert!(["cat", "dog"].contains(&value["kind"].as_str().unwrap_or("")), "{text}");
        let keys: Vec<&String> = value.as_object().expect("object").keys().collect();
        assert!(
            keys.iter().all(|k| ["name", "kind", "tags"].contains(&k.as_str())),
            "{text}"
        );
    }
    assert!(num_finished >= 20, "only {num_finished} walks finished");
}

#[tokio::test]
async fn regex_and_choices_and_lark_constrain_exactly() {
    let regex = compile(GrammarSpec::Regex("[0-9]{3}-[a-c]+".into())).await;
    for seed in 0..20 {
        let (text, finished) = random_walk(&regex, seed, 50);
        if finished {
            let (digits, letters) = text.split_once('-').expect("a dash");
            assert!(
                digits.len() == 3 && digits.chars().all(|c| c.is_ascii_digit()),
                "{text}"
            );
            assert!(
                !letters.is_empty() && letters.chars().all(|c| "abc".contains(c)),
                "{text}"
            );
        }
    }
    let choices = vec!["yes".to_owned(), "no (maybe)".to_owned()];
    let choice = compile(GrammarSpec::Choice(choices.clone())).await;
    for seed in 0..20 {
        let (text, finished) = random_walk(&choice, seed, 50);
        assert!(finished && choices.contains(&text), "{text:?}");
    }
    let lark = compile(GrammarSpec::Lark(
        "start: \"(\" NUM (\"+\" NUM)* \")\"\nNUM: /[1-9]/".into(),
    ))
    .await;
    for seed in 0..20 {
        let (text, finished) = random_walk(&lark, seed, 50);
        if finished {
            assert!(text.starts_with('(') && text.ends_with(')'), "{text}");
            assert!(text[1..text.len() - 1].split('+').all(|n| n.len() == 1), "{text}");
        }
    }
}

#[tokio::test]
async fn bad_grammars_are_errors_naming_the_problem() {
    let compiler = compiler();
    for spec in [
        GrammarSpec::JsonSchema(serde_json::json!({"type": "no-such-type"})),
        GrammarSpec::JsonSchema(serde_json::json!(3)),
        GrammarSpec::Regex("[unclosed".into()),
        GrammarSpec::Lark("start: missing_rule".into()),
        GrammarSpec::Choice(Vec::new()),
    ] {
        let error = compiler
            .compile(&spec)
            .await
            .err()
            .unwrap_or_else(|| panic!("{spec:?} compiled"));
        assert!(matches!(error, GrammarError::Invalid(_)), "{spec:?}: {error}");
        assert!(!error.to_string().is_empty());
    }
}

#[tokio::test]
async fn compiled_grammars_are_cached() {
    let compiler = compiler();
    let spec = GrammarSpec::Regex("a+".into());
    let first = compiler.compile(&spec).await.expect("compiles");
    let second = compiler.compile(&spec).await.expect("compiles");
    assert!(Arc::ptr_eq(&first.0, &second.0));
}

#[tokio::test]
async fn after_reasoning_the_grammar_holds_and_not_before() {
    let after = |is_open| GrammarSpec::AfterReasoning {
        is_open,
        answer: Box::new(GrammarSpec::Regex("[0-9]{3}".into())),
    };
    let allows =
        |matcher: &mut GrammarMatcher, ch: char| is_allowed(&matcher.allowed_tokens().expect("mask"), token_of(ch));
    let walk = |matcher: &mut GrammarMatcher, text: &str| {
        for ch in text.chars() {
            assert!(allows(matcher, ch), "{ch:?} of {text:?}");
            matcher.accept(token_of(ch)).expect("accepted");
        }
    };
    // Not open: the answer at once, or after a `<think>...</think>`; no other text first.
    let closed = compile(after(false)).await;
    let mut matcher = closed.matcher();
    assert!(!allows(&mut matcher, 'x'));
    walk(&mut matcher, "123");
    assert!(matcher.is_complete());
    let mut matcher = closed.matcher();
    walk(&mut matcher, "<think>a 1</thin>\nb</think>\n\n12");
    assert!(!matcher.is_complete() && !allows(&mut matcher, 'x'));
    walk(&mut matcher, "3");
    assert!(matcher.is_complete());
    // Open: anything (digits, `</thin`, newlines) up to the first `</think>`, then the answer.
    let open = compile(after(true)).await;
    let mut matcher = open.matcher();
    walk(&mut matcher, "x 1</thin>\n</think>");
    assert!(!matcher.is_complete() && !allows(&mut matcher, 'x'));
    walk(&mut matcher, "123");
    assert!(matcher.is_complete());
}

/// A pathological schema is refused with an error naming the problem: by llguidance's size limit
/// (thousands of alternatives of many properties), or by the wall-clock bound.
#[tokio::test]
async fn pathological_schemas_are_refused_quickly() {
    let alternatives: Vec<serde_json::Value> = (0..2000)
        .map(|i| {
            let properties: serde_json::Map<String, serde_json::Value> = (0..20)
                .map(|j| (format!("p{i}_{j}"), serde_json::json!({"type": "integer"})))
                .collect();
            serde_json::json!({"type": "object", "properties": properties})
        })
        .collect();
    let started = std::time::Instant::now();
    let error = compiler()
        .compile(&GrammarSpec::JsonSchema(serde_json::json!({"anyOf": alternatives})))
        .await
        .expect_err("too large");
    assert!(
        matches!(&error, GrammarError::Invalid(m) if m.contains("too large")),
        "{error}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    let values: Vec<String> = (0..20_000).map(|i| format!("value-{i}")).collect();
    let error = build_compiler()
        .with_timeout(std::time::Duration::from_millis(1))
        .compile(&GrammarSpec::JsonSchema(serde_json::json!({"enum": values})))
        .await
        .expect_err("too slow");
    assert!(error.to_string().contains("--grammar-compile-timeout"), "{error}");
}
