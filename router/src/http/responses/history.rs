//! How a turn continues a stored token history: its prompt is the stored tokens (the previous prompt and
//! answer, exactly) followed by the tokens of only the new turn, whose text the chat template itself
//! gives (`continuation_text`). Nothing earlier is rendered again, so the prefix cache holds the whole
//! previous turn by construction. Where that cannot be (other instructions or tools, a template that does
//! not render the new turn as an append), the whole conversation is rendered again, and logged.

use serde_json::Value;

use super::{super::AppState, input::message};
use crate::{
    api::openai::ChatMessage,
    chat_template::{ChatTemplate, ChatTemplateError},
    http::ApiError,
    validation::Prompt,
};

/// A conversation as the model saw it: the tokens, and the messages they render (for a later turn's text).
#[derive(Clone)]
pub(super) struct TokenHistory {
    /// The response's `instructions`: a later turn with others renders the conversation again.
    pub instructions: Option<String>,
    /// The chat template's variables (tools, reasoning effort): a later turn with others renders again.
    pub variables: serde_json::Map<String, Value>,
    /// The conversation after the instructions, this response's output last.
    pub messages: Vec<ChatMessage>,
    /// The prompt's token ids, then the generated ones.
    pub token_ids: Vec<u32>,
    /// The id of the conversation's first response: every turn of a `previous_response_id` chain pins
    /// its prefix under it, so each turn's pin replaces the last.
    pub session: String,
}

/// Marks where the answer goes when the template renders a turn, to find what closes an assistant turn.
const ANSWER_MARK: &str = "\u{1}rill-answer\u{1}";

/// What closing the previous answer still needs: the template's closing of an assistant turn, less the
/// end-of-turn token the model already generated when it starts that closing.
fn unclosed_part<'a>(closing: &'a str, last_special_token: Option<&str>) -> &'a str {
    match last_special_token {
        Some(token) if !token.is_empty() => closing.strip_prefix(token).unwrap_or(closing),
        _ => closing,
    }
}

/// The text that continues the token history `before` rendered (its last message the previous answer)
/// into the prompt of `conversation` (`before` and the new turn): the rest of the previous answer's
/// closing, then the template's rendering of the new turn with the generation prompt. None when the
/// template does not render the new turn as an append to the previous one.
fn continuation_text(
    template: &ChatTemplate,
    before: &[ChatMessage],
    conversation: &[ChatMessage],
    variables: &serde_json::Map<String, Value>,
    last_special_token: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let closed = template.render(before, false, variables)?;
    let next = template.render(conversation, true, variables)?;
    let Some(new_turn) = next.strip_prefix(&closed) else {
        return Ok(None);
    };
    let mut probe = before.to_vec();
    match probe.last_mut() {
        Some(last) if last.role == "assistant" => *last = message("assistant", Some(ANSWER_MARK.into())),
        _ => return Ok(None),
    }
    let probe = template.render(&probe, false, variables)?;
    let Some(at) = probe.rfind(ANSWER_MARK) else {
        return Ok(None);
    };
    let closing = &probe[at + ANSWER_MARK.len()..];
    Ok(Some(format!(
        "{}{new_turn}",
        unclosed_part(closing, last_special_token)
    )))
}

/// The prompt of a turn (and its text, for the reasoning parser): `previous`'s token history continued
/// by the new turn, or the whole conversation rendered. `conversation` is everything the prompt holds,
/// the instructions first, its last `num_new` messages the new turn's.
pub(super) async fn build_prompt(
    state: &AppState,
    previous: Option<&TokenHistory>,
    instructions: &Option<String>,
    conversation: &[ChatMessage],
    num_new: usize,
    variables: &serde_json::Map<String, Value>,
) -> Result<(Prompt, String), ApiError> {
    if let Some(history) = previous {
        if history.instructions == *instructions && history.variables == *variables {
            let before = &conversation[..conversation.len() - num_new];
            let last = *history.token_ids.last().expect("a history holds its prompt");
            let last_special = state.is_special(last).then(|| state.token_text(last));
            let template = state.chat_template.as_ref().ok_or(ChatTemplateError::Missing)?;
            match continuation_text(template, before, conversation, variables, last_special.as_deref())? {
                Some(text) => {
                    let encoding = state.validator.tokenize(text.clone(), false).await?;
                    let mut ids = history.token_ids.clone();
                    ids.extend_from_slice(encoding.get_ids());
                    return Ok((Prompt::Tokens(ids), text));
                }
                None => tracing::warn!(
                    "the chat template does not render a new turn as an append to the previous one: \
                     rendering the whole conversation again (its prefix may miss the cache)"
                ),
            }
        } else {
            tracing::debug!("instructions or tools changed since the previous response: rendering it all again");
        }
    }
    let text = state.render_chat(conversation, true, variables)?;
    let prompt = Prompt::Text {
        text: text.clone(),
        add_special_tokens: false,
    };
    Ok((prompt, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ChatML, as the default model's template writes it.
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn the_new_turn_follows_the_previous_answer() {
        let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).expect("valid");
        let before = [
            message("user", Some("Hi".into())),
            message("assistant", Some("Hello!".into())),
        ];
        let mut conversation = before.to_vec();
        conversation.push(message("user", Some("Bye".into())));
        let variables = serde_json::Map::new();
        let text = |last| continuation_text(&template, &before, &conversation, &variables, last).expect("renders");
        let new_turn = "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n";
        // The model ended its turn with <|im_end|>: only the newline is due.
        assert_eq!(text(Some("<|im_end|>")), Some(format!("\n{new_turn}")));
        // Cut off: the whole closing.
        assert_eq!(text(None), Some(format!("<|im_end|>\n{new_turn}")));
        // A template that renders earlier turns differently once another follows gives no append.
        let dropping = "{% for m in messages %}{% if loop.last or m.role != 'assistant' %}{{ m.content }};{% endif %}\
            {% endfor %}";
        let template = ChatTemplate::new(dropping.into(), String::new(), String::new()).expect("valid");
        assert_eq!(
            continuation_text(&template, &before, &conversation, &variables, None).expect("renders"),
            None
        );
    }

    #[test]
    fn the_generated_end_of_turn_is_not_closed_twice() {
        assert_eq!(unclosed_part("<|im_end|>\n", Some("<|im_end|>")), "\n");
        // Cut off by max_output_tokens: the whole closing is still due.
        assert_eq!(unclosed_part("<|im_end|>\n", None), "<|im_end|>\n");
        // An end-of-sequence token the template does not write: kept, and the closing follows.
        assert_eq!(unclosed_part("<|im_end|>\n", Some("</s>")), "<|im_end|>\n");
    }
}
