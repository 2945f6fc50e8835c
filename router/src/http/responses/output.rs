//! How a generated answer becomes a Responses `output`: the text is read token by token with chat's
//! `AnswerReader` (thinking apart, tool calls out), and each piece opens, grows or closes an output item
//! (`reasoning`, `message`, `function_call`), yielding the stream events that say so. The non-streaming
//! answer is built by the same steps, so both show the same items.

use super::super::{chat::AnswerReader, openai::uuid_like};
use crate::{
    api::{
        responses::{OutputContent, OutputItem, StreamEventKind},
        FinishReason,
    },
    engine::TokenEvent,
    text::tool_calls,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Reasoning,
    Message,
}

/// The item being written: its kind, id and text so far.
struct OpenItem {
    kind: TextKind,
    id: String,
    text: String,
}

/// Builds the output items of one answer.
pub(super) struct OutputBuilder {
    reader: AnswerReader,
    /// Items done, in order.
    items: Vec<OutputItem>,
    open: Option<OpenItem>,
    /// Answer text that is only whitespace so far and opened no message: a message starts only once
    /// the text shows more (so the blank line around a tool call makes no item).
    blank: String,
    /// Tokens whose text went to the thinking.
    num_reasoning_tokens: u32,
    /// The calls made, with their call ids, for the conversation's history.
    calls: Vec<(String, tool_calls::ToolCall)>,
}

fn text_part(kind: TextKind, text: String) -> OutputContent {
    match kind {
        TextKind::Reasoning => OutputContent::ReasoningText { text },
        TextKind::Message => OutputContent::OutputText {
            text,
            annotations: Vec::new(),
        },
    }
}

fn text_item(kind: TextKind, id: String, status: &'static str, content: Vec<OutputContent>) -> OutputItem {
    match kind {
        TextKind::Reasoning => OutputItem::Reasoning {
            id,
            summary: Vec::new(),
            content,
            status,
        },
        TextKind::Message => OutputItem::Message {
            id,
            role: "assistant",
            status,
            content,
        },
    }
}

impl OutputBuilder {
    pub fn new(reader: AnswerReader) -> Self {
        Self {
            reader,
            items: Vec::new(),
            open: None,
            blank: String::new(),
            num_reasoning_tokens: 0,
            calls: Vec::new(),
        }
    }

    /// Reads one token event; returns the stream events it makes.
    pub fn push(&mut self, event: &TokenEvent) -> Vec<StreamEventKind> {
        let mut events = Vec::new();
        let piece = self.reader.push(&event.text, event.end.is_some());
        if !piece.reasoning.is_empty() {
            self.num_reasoning_tokens += 1;
            self.write(TextKind::Reasoning, piece.reasoning, &mut events);
        }
        if !piece.content.is_empty() {
            let is_open = self.open.as_ref().is_some_and(|open| open.kind == TextKind::Message);
            if is_open || !piece.content.trim().is_empty() {
                let text = std::mem::take(&mut self.blank) + &piece.content;
                self.write(TextKind::Message, text, &mut events);
            } else {
                self.blank.push_str(&piece.content);
            }
        }
        for call in piece.calls {
            self.close("completed", &mut events);
            self.call(call, &mut events);
        }
        if let Some(end) = &event.end {
            let status = match end.finish_reason {
                FinishReason::Length => "incomplete",
                FinishReason::EosToken | FinishReason::StopSequence => "completed",
            };
            if self.items.is_empty() && self.open.is_none() {
                // An answer with nothing to show still answers: one message, maybe empty.
                let text = std::mem::take(&mut self.blank);
                self.open(TextKind::Message, &mut events);
                self.append(text, &mut events);
            }
            self.close(status, &mut events);
        }
        events
    }

    /// The items, once the answer ended.
    pub fn items(&self) -> &[OutputItem] {
        &self.items
    }

    pub fn num_reasoning_tokens(&self) -> u32 {
        self.num_reasoning_tokens
    }

    /// The answer's text and thinking (all items of each kind joined) and its calls with their call ids.
    pub fn answer(&self) -> (String, String, &[(String, tool_calls::ToolCall)]) {
        let (mut text, mut reasoning) = (String::new(), String::new());
        for item in &self.items {
            let (OutputItem::Message { content, .. } | OutputItem::Reasoning { content, .. }) = item else {
                continue;
            };
            for part in content {
                match part {
                    OutputContent::OutputText { text: part, .. } => text.push_str(part),
                    OutputContent::ReasoningText { text: part } => reasoning.push_str(part),
                }
            }
        }
        (text, reasoning, &self.calls)
    }

    /// Adds text of `kind`: to the open item when it is of that kind, else to a new one.
    fn write(&mut self, kind: TextKind, text: String, events: &mut Vec<StreamEventKind>) {
        if self.open.as_ref().is_none_or(|open| open.kind != kind) {
            self.close("completed", events);
            self.open(kind, events);
        }
        self.append(text, events);
    }

    fn open(&mut self, kind: TextKind, events: &mut Vec<StreamEventKind>) {
        let prefix = match kind {
            TextKind::Reasoning => "rs",
            TextKind::Message => "msg",
        };
        let id = format!("{prefix}_{}", uuid_like());
        let output_index = self.items.len() as u32;
        events.push(StreamEventKind::OutputItemAdded {
            output_index,
            item: text_item(kind, id.clone(), "in_progress", Vec::new()),
        });
        events.push(StreamEventKind::ContentPartAdded {
            item_id: id.clone(),
            output_index,
            content_index: 0,
            part: text_part(kind, String::new()),
        });
        self.open = Some(OpenItem {
            kind,
            id,
            text: String::new(),
        });
    }

    fn append(&mut self, delta: String, events: &mut Vec<StreamEventKind>) {
        let output_index = self.items.len() as u32;
        let open = self.open.as_mut().expect("text is appended to an open item");
        open.text.push_str(&delta);
        if delta.is_empty() {
            return;
        }
        let item_id = open.id.clone();
        events.push(match open.kind {
            TextKind::Reasoning => StreamEventKind::ReasoningTextDelta {
                item_id,
                output_index,
                content_index: 0,
                delta,
            },
            TextKind::Message => StreamEventKind::OutputTextDelta {
                item_id,
                output_index,
                content_index: 0,
                delta,
                logprobs: Vec::new(),
            },
        });
    }

    /// Closes the open item, if any, as `status`.
    fn close(&mut self, status: &'static str, events: &mut Vec<StreamEventKind>) {
        let Some(OpenItem { kind, id, text }) = self.open.take() else {
            return;
        };
        let output_index = self.items.len() as u32;
        events.push(match kind {
            TextKind::Reasoning => StreamEventKind::ReasoningTextDone {
                item_id: id.clone(),
                output_index,
                content_index: 0,
                text: text.clone(),
            },
            TextKind::Message => StreamEventKind::OutputTextDone {
                item_id: id.clone(),
                output_index,
                content_index: 0,
                text: text.clone(),
                logprobs: Vec::new(),
            },
        });
        events.push(StreamEventKind::ContentPartDone {
            item_id: id.clone(),
            output_index,
            content_index: 0,
            part: text_part(kind, text.clone()),
        });
        let item = text_item(kind, id, status, vec![text_part(kind, text)]);
        events.push(StreamEventKind::OutputItemDone {
            output_index,
            item: item.clone(),
        });
        self.items.push(item);
    }

    /// A whole call: its item added, its arguments in one delta, done.
    fn call(&mut self, call: tool_calls::ToolCall, events: &mut Vec<StreamEventKind>) {
        let id = format!("fc_{}", uuid_like());
        let call_id = format!("call_{}", uuid_like());
        let output_index = self.items.len() as u32;
        let item = |arguments: String, status| OutputItem::FunctionCall {
            id: id.clone(),
            call_id: call_id.clone(),
            name: call.name.clone(),
            arguments,
            status,
        };
        events.push(StreamEventKind::OutputItemAdded {
            output_index,
            item: item(String::new(), "in_progress"),
        });
        events.push(StreamEventKind::FunctionCallArgumentsDelta {
            item_id: id.clone(),
            output_index,
            delta: call.arguments.clone(),
        });
        events.push(StreamEventKind::FunctionCallArgumentsDone {
            item_id: id.clone(),
            output_index,
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        });
        let done = item(call.arguments.clone(), "completed");
        events.push(StreamEventKind::OutputItemDone {
            output_index,
            item: done.clone(),
        });
        self.items.push(done);
        self.calls.push((call_id, call));
    }
}
