//! One answer shaped into Anthropic's content blocks, as stream events and as the whole message.

use serde_json::Value;

use super::super::{chat::AnswerReader, openai::uuid_like, Finished};
use crate::{
    api::{
        anthropic::{BlockDelta, ContentBlock, Message, MessageDelta, MessageUsage, StopReason, StreamEvent},
        FinishReason,
    },
    engine::EndEvent,
    text::tool_calls,
};

/// The kinds of block the answer's text is read into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Thinking,
    Text,
}

/// Shapes one answer into content blocks, as stream events (`push`) and as the whole message
/// (`build`). Blocks open in the order the text arrives: thinking, then text and tool calls; a block
/// of only whitespace is never opened (the whitespace is held until something else follows it).
pub(super) struct MessageBuilder {
    reader: AnswerReader,
    /// The message so far: blocks are appended to as the text arrives.
    message: Message,
    /// Whether the last block of `message.content` is still open.
    is_open: bool,
    /// Whitespace that would open a block of this kind, held back.
    held: Option<(TextKind, String)>,
    /// Whether the stream's one `ping` was sent (after the first `content_block_start`, as Anthropic's API).
    has_pinged: bool,
    /// The index among the answer's calls of the call whose `tool_use` block is open.
    open_call: Option<u32>,
}

impl MessageBuilder {
    pub(super) fn new(id: String, model: String, reader: AnswerReader, num_prompt_tokens: u32) -> Self {
        let usage = MessageUsage {
            input_tokens: num_prompt_tokens,
            ..MessageUsage::default()
        };
        Self {
            reader,
            message: Message {
                id,
                kind: "message",
                role: "assistant",
                content: Vec::new(),
                model,
                stop_reason: None,
                stop_sequence: None,
                usage,
            },
            is_open: false,
            held: None,
            has_pinged: false,
            open_call: None,
        }
    }

    /// The stream's first event. Its usage counts the whole prompt as `input_tokens`: what the prefix
    /// cache served is known only at the end, in `message_delta`'s usage.
    pub(super) fn start(&self) -> StreamEvent {
        StreamEvent::MessageStart {
            message: self.message.clone(),
        }
    }

    /// The whole message of a finished answer.
    pub(super) fn build(mut self, finished: Finished) -> Message {
        let num_tokens = finished.tokens.len();
        for (i, token) in finished.tokens.iter().enumerate() {
            self.push(&token.text, (i + 1 == num_tokens).then_some(&finished.end));
        }
        self.message
    }

    /// The events of the next piece of text; with `end`, the last piece, and the message's end.
    pub(super) fn push(&mut self, text: &str, end: Option<&EndEvent>) -> Vec<StreamEvent> {
        let piece = self.reader.push(text, end.is_some());
        let mut events = Vec::new();
        self.push_text(TextKind::Thinking, &piece.reasoning, &mut events);
        // A piece's text precedes the calls it starts but follows the end of the call already open
        // (the text after a call, or a cut-off call given back as text).
        let mut open = piece.deltas;
        let num_open = open
            .iter()
            .take_while(|d| d.name.is_none() && Some(d.index) == self.open_call)
            .count();
        let new = open.split_off(num_open);
        let mut calls = piece.calls.into_iter();
        self.push_deltas(open, &mut calls, &mut events);
        if self.open_call.is_some() {
            self.complete_call(&mut calls, &mut events);
        }
        self.push_text(TextKind::Text, &piece.content, &mut events);
        self.push_deltas(new, &mut calls, &mut events);
        self.complete_call(&mut calls, &mut events);
        if let Some(end) = end {
            self.finish(end, &mut events);
        }
        events
    }

    fn push_text(&mut self, kind: TextKind, text: &str, events: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        let open_kind = match self.message.content.last() {
            Some(ContentBlock::Text { .. }) if self.is_open => Some(TextKind::Text),
            Some(ContentBlock::Thinking { .. }) if self.is_open => Some(TextKind::Thinking),
            _ => None,
        };
        let mut text = text.to_owned();
        if open_kind != Some(kind) {
            let held = match &mut self.held {
                Some((held_kind, held)) if *held_kind == kind => held,
                held => &mut held.insert((kind, String::new())).1,
            };
            held.push_str(&text);
            if held.trim().is_empty() {
                return;
            }
            text = std::mem::take(held);
            self.held = None;
            self.close(events);
            let block = match kind {
                TextKind::Thinking => ContentBlock::Thinking {
                    thinking: String::new(),
                    signature: String::new(),
                },
                TextKind::Text => ContentBlock::Text { text: String::new() },
            };
            self.open(block, events);
        }
        let index = self.message.content.len() as u32 - 1;
        let delta = match self.message.content.last_mut() {
            Some(ContentBlock::Thinking { thinking, .. }) => {
                thinking.push_str(&text);
                BlockDelta::ThinkingDelta { thinking: text }
            }
            Some(ContentBlock::Text { text: all }) => {
                all.push_str(&text);
                BlockDelta::TextDelta { text }
            }
            _ => unreachable!("a text or thinking block is open"),
        };
        events.push(StreamEvent::ContentBlockDelta { index, delta });
    }

    /// Streams pieces of calls: a call's first opens its `tool_use` block (with an empty input, as
    /// Anthropic's API), each piece of arguments is an `input_json_delta`.
    /// `calls`: the calls the piece completes, in order (the first is the open call, if any).
    fn push_deltas(
        &mut self,
        deltas: Vec<tool_calls::CallDelta>,
        calls: &mut impl Iterator<Item = tool_calls::ToolCall>,
        events: &mut Vec<StreamEvent>,
    ) {
        for delta in deltas {
            if let Some(name) = delta.name {
                if self.open_call.is_some() {
                    self.complete_call(calls, events);
                }
                self.held = None;
                self.close(events);
                let opening = ContentBlock::ToolUse {
                    id: format!("toolu_{}", uuid_like()),
                    name,
                    input: Value::Object(serde_json::Map::new()),
                };
                self.open(opening, events);
                self.open_call = Some(delta.index);
            }
            // (A call's pieces after its block closed, cut off by text, are not sent.)
            if !delta.arguments.is_empty() && self.open_call == Some(delta.index) {
                events.push(StreamEvent::ContentBlockDelta {
                    index: self.message.content.len() as u32 - 1,
                    delta: BlockDelta::InputJsonDelta {
                        partial_json: delta.arguments,
                    },
                });
            }
        }
    }

    /// The open call completes if `calls` has a call (its deltas were streamed): its block gets the
    /// whole input, and closes.
    fn complete_call(&mut self, calls: &mut impl Iterator<Item = tool_calls::ToolCall>, events: &mut Vec<StreamEvent>) {
        let Some(call) = calls.next() else {
            return;
        };
        assert!(self.open_call.is_some(), "a completed call was streamed");
        // The parser gives back calls whose arguments are JSON (anything else stays text).
        let whole = serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments));
        if let Some(ContentBlock::ToolUse { input, .. }) = self.message.content.last_mut() {
            *input = whole;
        }
        self.close(events);
    }

    /// Opens `block` (empty) as the next block; returns its index.
    fn open(&mut self, block: ContentBlock, events: &mut Vec<StreamEvent>) -> u32 {
        let index = self.message.content.len() as u32;
        events.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block.clone(),
        });
        if !self.has_pinged {
            self.has_pinged = true;
            events.push(StreamEvent::Ping);
        }
        self.message.content.push(block);
        self.is_open = true;
        index
    }

    /// Closes the open block, if any (a thinking block gets its signature first).
    fn close(&mut self, events: &mut Vec<StreamEvent>) {
        if !self.is_open {
            return;
        }
        self.is_open = false;
        // A call closed before it completed (cut off) keeps the empty input it opened with.
        self.open_call = None;
        let index = self.message.content.len() as u32 - 1;
        if let Some(ContentBlock::Thinking { signature, .. }) = self.message.content.last() {
            events.push(StreamEvent::ContentBlockDelta {
                index,
                delta: BlockDelta::SignatureDelta {
                    signature: signature.clone(),
                },
            });
        }
        events.push(StreamEvent::ContentBlockStop { index });
    }

    fn finish(&mut self, end: &EndEvent, events: &mut Vec<StreamEvent>) {
        self.held = None;
        self.close(events);
        let has_calls = self
            .message
            .content
            .iter()
            .any(|block| matches!(block, ContentBlock::ToolUse { .. }));
        let stop_reason = match end.finish_reason {
            FinishReason::Length => StopReason::MaxTokens,
            FinishReason::StopSequence if end.stop_sequence.is_some() => StopReason::StopSequence,
            _ if has_calls => StopReason::ToolUse,
            _ => StopReason::EndTurn,
        };
        let usage = MessageUsage {
            input_tokens: end.num_prompt_tokens - end.num_cached_tokens,
            output_tokens: end.num_generated_tokens,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: end.num_cached_tokens,
        };
        self.message.stop_reason = Some(stop_reason);
        self.message.stop_sequence = end.stop_sequence.clone();
        self.message.usage = usage;
        events.push(StreamEvent::MessageDelta {
            delta: MessageDelta {
                stop_reason,
                stop_sequence: end.stop_sequence.clone(),
            },
            usage,
        });
        events.push(StreamEvent::MessageStop);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::text::{reasoning::ReasoningFormat, tool_calls::ToolCallFormat};

    fn end(reason: FinishReason, stop_sequence: Option<&str>) -> EndEvent {
        EndEvent {
            finish_reason: reason,
            generated_text: String::new(),
            num_generated_tokens: 9,
            num_prompt_tokens: 20,
            num_cached_tokens: 16,
            stop_sequence: stop_sequence.map(str::to_owned),
        }
    }

    fn builder() -> MessageBuilder {
        let reader = AnswerReader::new(
            Some(ReasoningFormat::DeepseekR1),
            Some((ToolCallFormat::Hermes, &[])),
            "",
        );
        MessageBuilder::new("msg_1".into(), "m".into(), reader, 20)
    }

    /// Thinking, text and a call, fed one character at a time, make exactly Anthropic's event sequence
    /// (the call's arguments streamed as they are written); the whole message built from the same text
    /// agrees with what the events accumulate to.
    #[test]
    fn events_follow_anthropic_sequence_and_agree_with_the_message() {
        let text = "Let me see.</think>\n\nChecking.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n";
        let mut builder = builder();
        let mut events = vec![builder.start()];
        let chars: Vec<char> = text.chars().collect();
        let stop = end(FinishReason::EosToken, None);
        for (i, c) in chars.iter().enumerate() {
            events.extend(builder.push(&c.to_string(), (i + 1 == chars.len()).then_some(&stop)));
        }
        let names: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        let deltas = |n| vec!["content_block_delta"; n];
        let expected = [
            vec!["message_start", "content_block_start", "ping"],
            deltas("Let me see.".len() + 1), // a character each, and the signature
            vec!["content_block_stop", "content_block_start"],
            deltas("Checking.\n".len()),
            vec!["content_block_stop", "content_block_start"],
            deltas(r#"{"city":"Paris"}"#.len()), // the compact arguments, a character each
            vec!["content_block_stop", "message_delta", "message_stop"],
        ]
        .concat();
        assert_eq!(names, expected);
        let message = builder.message.clone();
        let input = json!({"city": "Paris"});
        match &message.content[..] {
            [ContentBlock::Thinking { thinking, .. }, ContentBlock::Text { text }, ContentBlock::ToolUse { id, name, input: got }] =>
            {
                assert_eq!((thinking.as_str(), text.as_str()), ("Let me see.", "Checking.\n"));
                assert!(
                    id.starts_with("toolu_") && name == "weather" && *got == input,
                    "{message:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        let pieces: Vec<&str> = events
            .iter()
            .filter_map(|event| match event {
                StreamEvent::ContentBlockDelta {
                    index: 2,
                    delta: BlockDelta::InputJsonDelta { partial_json },
                } => Some(partial_json.as_str()),
                _ => None,
            })
            .collect();
        let expected: Vec<String> = r#"{"city":"Paris"}"#.chars().map(String::from).collect();
        assert_eq!(pieces, expected);
        assert_eq!(serde_json::from_str::<Value>(&pieces.concat()).expect("JSON"), input);
        assert_eq!(message.stop_reason, Some(StopReason::ToolUse));
        let usage = MessageUsage {
            input_tokens: 4,
            output_tokens: 9,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: 16,
        };
        assert_eq!(message.usage, usage);
        match &events[events.len() - 2] {
            StreamEvent::MessageDelta { delta, usage: got } => {
                assert_eq!((delta.stop_reason, *got), (StopReason::ToolUse, usage))
            }
            other => panic!("{other:?}"),
        }
        let serialized = serde_json::to_value(&events[0]).expect("serializes");
        assert_eq!(serialized["type"], "message_start");
        assert_eq!(serialized["message"]["content"], json!([]));
        assert_eq!(serialized["message"]["usage"]["input_tokens"], 20);
    }

    #[test]
    fn stop_reasons_and_whitespace_only_blocks() {
        let mut shaper = builder();
        shaper.push("Done.</think>", None);
        let events = shaper.push("\n  ", Some(&end(FinishReason::StopSequence, Some("END"))));
        let names: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        // The thinking block closes with its signature; the whitespace opens no text block.
        let expected = [
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ];
        assert_eq!(names, expected);
        assert_eq!(shaper.message.content.len(), 1);
        assert_eq!(shaper.message.stop_reason, Some(StopReason::StopSequence));
        assert_eq!(shaper.message.stop_sequence.as_deref(), Some("END"));
        let mut shaper = builder();
        shaper.push("a</think>b", Some(&end(FinishReason::Length, None)));
        assert_eq!(shaper.message.stop_reason, Some(StopReason::MaxTokens));
        let mut shaper = builder();
        shaper.push("a</think>b", Some(&end(FinishReason::EosToken, None)));
        assert_eq!(shaper.message.stop_reason, Some(StopReason::EndTurn));
    }

    /// A call cut off by `max_tokens`: its block, opened and streamed, closes with the empty input it
    /// opened with; its text is given back as a text block (as chat gives it back as content).
    #[test]
    fn a_cut_off_call_closes_and_its_text_follows() {
        let text = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Pa";
        let reader = AnswerReader::new(None, Some((ToolCallFormat::Hermes, &[])), "");
        let mut builder = MessageBuilder::new("msg_1".into(), "m".into(), reader, 20);
        let mut events = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        let stop = end(FinishReason::Length, None);
        for (i, c) in chars.iter().enumerate() {
            events.extend(builder.push(&c.to_string(), (i + 1 == chars.len()).then_some(&stop)));
        }
        let names: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        let expected = [
            vec!["content_block_start", "ping"],
            vec!["content_block_delta"; r#"{"city":"Pa"#.len()],
            vec![
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
            ],
            vec!["message_delta", "message_stop"],
        ]
        .concat();
        assert_eq!(names, expected);
        match &builder.message.content[..] {
            [ContentBlock::ToolUse { name, input, .. }, ContentBlock::Text { text: given_back }] => {
                assert_eq!((name.as_str(), input), ("weather", &json!({})));
                assert_eq!(given_back, text);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(builder.message.stop_reason, Some(StopReason::MaxTokens));
    }
}
